// Small text helpers shared by config errors, the dry-run report and logging.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// Edit distance (insert, delete, substitute, transpose adjacent) between two keys.
int edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word`, if it is close enough to be a plausible typo; else "".
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// 15797120 -> "15,797,120"
std::string with_commas(int64_t n);

// 3.2e9 bytes -> "2.98 GiB"; uses B, KiB, MiB, GiB, TiB.
std::string human_bytes(double bytes);

// 7.012e6 -> "7.012 M"; k, M, G, T, P, E with four significant digits.
std::string human_count(double n);

std::string join(const std::vector<std::string>& parts, std::string_view sep);
// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
std::vector<std::string> split(std::string_view text, char sep);

// Untrusted text (read from a file, a config value) made safe to print on one line: control
// characters, backslashes and bytes outside printable ASCII as \xNN, cut after `max` bytes of
// input with "... (N bytes)".
std::string printable(std::string_view text, size_t max = 200);

// Ranks as a compact list: "0 1 2 3" or, when long, "0 8 16 … 1016 (128 ranks)".
std::string format_rank_list(const std::vector<int>& ranks, size_t max_shown = 16);

}  // namespace dstrain

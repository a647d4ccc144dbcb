#include "engine/common/strings.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace dstrain {

int edit_distance(std::string_view a, std::string_view b) {
  // Optimal string alignment distance: Levenshtein plus adjacent transpositions.
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1, 0));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_distance = 0;
  for (const auto& c : candidates) {
    const int dist = edit_distance(word, c);
    if (best.empty() || dist < best_distance) {
      best = c;
      best_distance = dist;
    }
  }
  // A plausible typo: at most a third of the longer word changed, and never more than 4 edits.
  const int allowed = std::min<int>(4, std::max<int>(1, static_cast<int>(
                                                            std::max(word.size(), best.size()) / 3)));
  return (!best.empty() && best_distance <= allowed) ? best : std::string();
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  const int len = static_cast<int>(digits.size());
  for (int i = 0; i < len; ++i) {
    if (i > 0 && (len - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return n < 0 ? "-" + out : out;
}

std::string human_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  while (std::fabs(bytes) >= 1024.0 && unit < 5) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, kUnits[unit]);
}

std::string human_count(double n) {
  static const char* kUnits[] = {"", " k", " M", " G", " T", " P", " E"};
  int unit = 0;
  while (std::fabs(n) >= 1000.0 && unit < 6) {
    n /= 1000.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{:.0f}", n);
  const int decimals = std::fabs(n) >= 100 ? 1 : std::fabs(n) >= 10 ? 2 : 3;
  return fmt::format("{:.{}f}{}", n, decimals, kUnits[unit]);
}

std::vector<std::string> split(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i)
    if (i == text.size() || text[i] == sep) {
      out.emplace_back(text.substr(start, i - start));
      start = i + 1;
    }
  return out;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

std::string format_rank_list(const std::vector<int>& ranks, size_t max_shown) {
  std::vector<std::string> parts;
  if (ranks.size() <= max_shown) {
    for (int r : ranks) parts.push_back(std::to_string(r));
    return join(parts, " ");
  }
  const size_t head = max_shown - 1;
  for (size_t i = 0; i < head; ++i) parts.push_back(std::to_string(ranks[i]));
  return fmt::format("{} ... {} ({} ranks)", join(parts, " "), ranks.back(), ranks.size());
}

std::string printable(std::string_view text, size_t max) {
  std::string out;
  const size_t n = std::min(text.size(), max);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(char(c));
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  if (text.size() > max) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

}  // namespace dstrain

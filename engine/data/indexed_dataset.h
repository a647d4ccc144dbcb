// Megatron-LM's indexed dataset (the "MMIDIDX" format its preprocess_data.py writes), read and
// written here so that data prepared for Megatron trains unchanged (docs/design.md §2.4.1):
//
//   PREFIX.idx  little-endian: the 9 bytes "MMIDIDX\0\0", version uint64 = 1, the element type's
//               code uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
//               8 uint16), the sequence count S uint64, the document count D uint64, then
//               int32 lengths[S] (elements per sequence), int64 pointers[S] (each sequence's
//               byte offset in PREFIX.bin), int64 documents[D] (the sequence index where each
//               document starts, 0 first; the last is S), and, in Megatron's multimodal case
//               only, int8 modes[S].
//   PREFIX.bin  the sequences' elements, one after another.
//
// dstrain reads the token stream as the concatenation of all sequences in file order (the
// pointers must be the running sum of the lengths, as Megatron's writer makes them), a window at a
// time: nothing of either file is held in memory beyond the window being read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::data {

struct MegatronIndex {
  std::string prefix;
  int dtype_code = 0;
  int64_t itemsize = 0;   // bytes per element in PREFIX.bin
  int64_t sequences = 0, documents = 0;  // documents: the index's boundary entries (one more than documents)
  int64_t tokens = 0;     // elements in all sequences
  bool multimodal = false;
};

// Reads PREFIX.idx from end to end and checks it against PREFIX.bin: the header, the element
// type (an integer type: token ids), lengths >= 0, contiguous pointers, document starts rising
// from 0 to S, the file sizes. Throws ConfigError naming the file and the fault.
MegatronIndex read_megatron_index(const std::string& prefix);

// Reads elements [first, first + n) of the token stream into out (as int32; a value outside
// [0, vocab) is a ConfigError naming the file and the position). One positioned read.
class MegatronReader {
 public:
  explicit MegatronReader(const MegatronIndex& index);
  ~MegatronReader();
  MegatronReader(const MegatronReader&) = delete;
  MegatronReader& operator=(const MegatronReader&) = delete;
  void read(int64_t first, int64_t n, int64_t vocab, int32_t* out) const;
  const MegatronIndex& index() const { return idx_; }

 private:
  MegatronIndex idx_;
  int fd_ = -1;
  mutable std::vector<char> buf_;
};

// Writes PREFIX.bin and PREFIX.idx as Megatron's writer does: one sequence per document, uint16
// elements where the vocabulary has fewer than 65,500 tokens, int32 otherwise (Megatron's rule).
void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& documents,
                            int64_t vocab_size);

}  // namespace dstrain::data

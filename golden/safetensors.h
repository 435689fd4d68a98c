// safetensors I/O (SPEC §14 file layout) with a reader that treats every byte string as untrusted.
//
// Layout: u64 little-endian header length n, n bytes of UTF-8 JSON starting with '{' (the writer
// pads it with spaces to a multiple of 8), then the data buffer. Each tensor entry is
// {"dtype", "shape", "data_offsets": [begin, end]} relative to the buffer; the entries cover the
// buffer with no hole or overlap. "__metadata__" maps strings to strings.
//
// The reader rejects everything the safetensors crate rejects (header too small or too large,
// truncated header, not UTF-8, not starting with '{', bad JSON, offsets not contiguous or out of
// range, shape*dtype overflow, length mismatch, buffer size mismatch) and also duplicate JSON keys
// at any level, non-string metadata, unknown or disallowed dtypes, non-integer or negative
// numbers, unknown or missing entry fields, BOOL bytes other than 0/1, and nesting deeper than a
// header needs. Every rejection is a FormatError naming the file and the fault. No registry
// dependency here, so the fuzz target stays small.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "harness/core/tensor.h"

namespace moe::golden {

// The kind of a rejection; tests and the fuzzer check it, people read the message.
enum class Fault : uint8_t {
  io,                      // cannot open/read the file
  header_too_small,        // fewer than 8 bytes
  header_too_large,        // n > kMaxHeaderLen
  truncated_header,        // 8 + n > file size
  not_utf8,                // header bytes are not valid UTF-8
  header_start,            // header does not begin with '{'
  bad_json,                // JSON syntax error
  duplicate_key,           // the same key twice in one JSON object
  too_deep,                // nesting or array length beyond what a header needs
  bad_metadata,            // __metadata__ not an object of strings
  bad_entry,               // tensor entry not an object, missing/unknown field, wrong field type
  unknown_dtype,           // dtype not one of F64 F32 BF16 F16 I64 I32 U8 BOOL
  bad_number,              // offset or dimension not a non-negative integer
  offsets_not_contiguous,  // hole, overlap or end < begin
  offsets_out_of_range,    // end beyond the data buffer
  shape_overflow,          // element count or byte size overflows
  length_mismatch,         // end - begin != numel * dtype size
  buffer_size_mismatch,    // data buffer longer than the tensors cover
  bad_bool,                // BOOL byte other than 0x00 / 0x01
  schema,                  // valid safetensors, but not a valid moe-golden/1 file
};
std::string_view fault_name(Fault f);

class FormatError : public std::runtime_error {
 public:
  FormatError(const std::string& file, Fault fault, const std::string& detail);
  Fault fault() const { return fault_; }
  const std::string& file() const { return file_; }
  const std::string& detail() const { return detail_; }

 private:
  std::string file_;
  Fault fault_;
  std::string detail_;
};

using Metadata = std::map<std::string, std::string>;

struct File {
  Metadata metadata;
  TensorMap tensors;
  uint64_t header_len = 0;  // n, padding included
};

// safetensors' own limit (MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderLen = 100'000'000;

// "F32", "BF16", ... (safetensors spelling) and back; nullopt for anything not allowed by §14.
std::string_view dtype_code(DType dt);
std::optional<DType> parse_dtype_code(std::string_view code);

// Serialises tensors (ascending byte-wise name order, first at offset 0) and metadata. Throws
// std::invalid_argument for a name it cannot store or a BOOL tensor holding bytes other than 0/1.
std::string serialize(const TensorMap& tensors, const Metadata& metadata);
void write_file(const std::string& path, const TensorMap& tensors, const Metadata& metadata);

// Parses a whole file image. `source` names the file in errors. Throws FormatError only.
File parse(std::string_view bytes, const std::string& source);
File read_file(const std::string& path);  // FormatError(io) if it cannot be read

// JSON with every object's keys unique, nesting at most max_depth and arrays at most max_array
// elements (the header's needs), parsed with the SAX interface. Throws FormatError(bad_json,
// duplicate_key or too_deep) naming source and what.
nlohmann::json parse_json_strict(std::string_view text, const std::string& source,
                                 const std::string& what, int max_depth, size_t max_array);

bool valid_utf8(std::string_view s);

}  // namespace moe::golden

#include "golden/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <tuple>
#include <vector>

namespace moe::golden {

namespace {

using json = nlohmann::json;

constexpr std::pair<DType, std::string_view> kCodes[] = {
    {DType::f64, "F64"}, {DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
    {DType::i64, "I64"}, {DType::i32, "I32"}, {DType::u8, "U8"},     {DType::boolean, "BOOL"},
};

// dtypes the safetensors crate knows but §14 does not allow: named in the error so a file written
// with, say, I16 gets a precise message rather than "unknown".
constexpr std::string_view kDisallowedCodes[] = {"I8",      "I16",     "U16",     "U32",
                                                 "U64",     "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                                 "F6_E2M3", "F6_E3M2", "F4",      "C64"};

uint64_t load_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

void store_le64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

// Builds a DOM through the SAX interface so that duplicate keys, excessive nesting and overlong
// arrays stop the parse at once (nlohmann's DOM parser keeps the last duplicate silently).
class StrictSax {
 public:
  StrictSax(int max_depth, size_t max_array) : max_depth_(max_depth), max_array_(max_array) {}

  bool null() { return put(json(nullptr)) != nullptr; }
  bool boolean(bool v) { return put(json(v)) != nullptr; }
  bool number_integer(json::number_integer_t v) { return put(json(v)) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t&) {
    return put(json(v)) != nullptr;
  }
  bool string(json::string_t& v) { return put(json(std::move(v))) != nullptr; }
  bool binary(json::binary_t&) { return stop(Fault::bad_json, "binary value"); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    Frame& f = stack_.back();
    if (f.node->contains(k)) return stop(Fault::duplicate_key, "duplicate key '" + k + "'");
    f.key = std::move(k);
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& ex) {
    return stop(Fault::bad_json, "at byte " + std::to_string(pos) + ": " + ex.what());
  }

  json root;
  Fault fault = Fault::bad_json;
  std::string error;

 private:
  struct Frame {
    json* node;
    std::string key;  // pending key of an object
  };

  bool stop(Fault f, std::string msg) {
    if (error.empty()) {
      fault = f;
      error = std::move(msg);
    }
    return false;
  }

  // Places v in the innermost open container (or as the root); returns where it went. Pointers
  // to open containers stay valid: a map never moves its nodes, and an array gets no new element
  // while one of its children is open.
  json* put(json&& v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    Frame& f = stack_.back();
    if (f.node->is_array()) {
      if (f.node->size() >= max_array_) {
        stop(Fault::too_deep, "array longer than " + std::to_string(max_array_) + " elements");
        return nullptr;
      }
      f.node->push_back(std::move(v));
      return &f.node->back();
    }
    json& slot = (*f.node)[f.key];
    slot = std::move(v);
    return &slot;
  }

  bool open(json&& container) {
    if (static_cast<int>(stack_.size()) >= max_depth_) {
      return stop(Fault::too_deep, "nesting deeper than " + std::to_string(max_depth_));
    }
    json* where = put(std::move(container));
    if (!where) return false;
    stack_.push_back({where, {}});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  int max_depth_;
  size_t max_array_;
  std::vector<Frame> stack_;
};

std::string json_kind(const json& v) {
  if (v.is_number_unsigned()) return "the integer " + v.dump();
  if (v.is_number_integer()) return "the negative integer " + v.dump();
  if (v.is_number_float()) return "the non-integer number " + v.dump();
  return std::string("a ") + v.type_name();
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

}  // namespace

std::string_view fault_name(Fault f) {
  switch (f) {
    case Fault::io:
      return "cannot read";
    case Fault::header_too_small:
      return "header too small";
    case Fault::header_too_large:
      return "header too large";
    case Fault::truncated_header:
      return "truncated header";
    case Fault::not_utf8:
      return "header not UTF-8";
    case Fault::header_start:
      return "header does not start with '{'";
    case Fault::bad_json:
      return "invalid JSON";
    case Fault::duplicate_key:
      return "duplicate JSON key";
    case Fault::too_deep:
      return "JSON structure too deep or too long";
    case Fault::bad_metadata:
      return "invalid __metadata__";
    case Fault::bad_entry:
      return "invalid tensor entry";
    case Fault::unknown_dtype:
      return "unknown dtype";
    case Fault::bad_number:
      return "not a non-negative integer";
    case Fault::offsets_not_contiguous:
      return "data offsets not contiguous";
    case Fault::offsets_out_of_range:
      return "data offsets out of range";
    case Fault::shape_overflow:
      return "shape size overflows";
    case Fault::length_mismatch:
      return "tensor length mismatch";
    case Fault::buffer_size_mismatch:
      return "buffer size mismatch";
    case Fault::bad_bool:
      return "invalid BOOL byte";
    case Fault::schema:
      return "not a moe-golden/1 file";
  }
  return "?";
}

FormatError::FormatError(const std::string& file, Fault fault, const std::string& detail)
    : std::runtime_error(file + ": " + std::string(fault_name(fault)) + ": " + detail),
      file_(file),
      fault_(fault),
      detail_(detail) {}

std::string_view dtype_code(DType dt) {
  for (auto& [d, c] : kCodes)
    if (d == dt) return c;
  return "?";
}

std::optional<DType> parse_dtype_code(std::string_view code) {
  for (auto& [d, c] : kCodes)
    if (c == code) return d;
  return std::nullopt;
}

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  auto cont = [&](size_t k, uint8_t lo = 0x80, uint8_t hi = 0xBF) {
    return i + k < n && p[i + k] >= lo && p[i + k] <= hi;
  };
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      i += 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      if (!cont(1)) return false;
      i += 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      // E0 needs A0..BF (no overlongs); ED needs 80..9F (no surrogates).
      const uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
      if (!cont(1, lo, hi) || !cont(2)) return false;
      i += 3;
    } else if (c >= 0xF0 && c <= 0xF4) {
      // F0 needs 90..BF (no overlongs); F4 needs 80..8F (nothing above U+10FFFF).
      const uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
      if (!cont(1, lo, hi) || !cont(2) || !cont(3)) return false;
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

json parse_json_strict(std::string_view text, const std::string& source, const std::string& what,
                       int max_depth, size_t max_array) {
  // nlohmann's lexer takes a NUL byte for the end of input, so "{}\0junk" would parse; JSON has
  // no place for a raw NUL anyway.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos) {
    throw FormatError(source, Fault::bad_json,
                      what + ": NUL byte at offset " + std::to_string(nul));
  }
  StrictSax sax(max_depth, max_array);
  const bool ok = json::sax_parse(text.begin(), text.end(), &sax, json::input_format_t::json,
                                  /*strict=*/true, /*ignore_comments=*/false);
  if (!ok || !sax.error.empty()) {
    throw FormatError(source, sax.fault,
                      what + ": " + (sax.error.empty() ? std::string("rejected") : sax.error));
  }
  return std::move(sax.root);
}

std::string serialize(const TensorMap& tensors, const Metadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (auto& [k, v] : metadata) {
      if (!valid_utf8(k) || !valid_utf8(v)) {
        throw std::invalid_argument("metadata: key '" + k + "' or its value is not UTF-8");
      }
      m[k] = v;
    }
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__" || !valid_utf8(name)) {
      throw std::invalid_argument("tensor name '" + name + "' cannot be stored");
    }
    if (t.dtype() == DType::boolean) {
      const auto* b = reinterpret_cast<const uint8_t*>(t.bytes());
      for (size_t i = 0; i < t.nbytes(); ++i) {
        if (b[i] > 1) {
          throw std::invalid_argument("tensor " + name + ": BOOL element " + std::to_string(i) +
                                      " holds byte " + std::to_string(b[i]));
        }
      }
    }
    json e = json::object();
    e["dtype"] = dtype_code(t.dtype());
    e["shape"] = t.shape();
    e["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
    header[name] = std::move(e);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + text.size() + offset);
  store_le64(out, text.size());
  out += text;
  for (auto& [name, t] : tensors) out.append(reinterpret_cast<const char*>(t.bytes()), t.nbytes());
  return out;
}

void write_file(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  const std::string bytes = serialize(tensors, metadata);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error(path + ": cannot open for writing");
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) throw std::runtime_error(path + ": write failed");
}

File read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(path, Fault::io, "cannot open: " + std::string(std::strerror(errno)));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw FormatError(path, Fault::io, "read failed");
  return parse(ss.str(), path);
}

File parse(std::string_view bytes, const std::string& source) {
  auto fail = [&](Fault f, const std::string& d) { return FormatError(source, f, d); };
  if (bytes.size() < 8) {
    throw fail(Fault::header_too_small, "file has " + std::to_string(bytes.size()) +
                                            " bytes, fewer than the 8-byte header length");
  }
  const uint64_t n = load_le64(bytes.data());
  if (n > kMaxHeaderLen) {
    throw fail(Fault::header_too_large,
               "header length " + std::to_string(n) + " exceeds " + std::to_string(kMaxHeaderLen));
  }
  if (n > bytes.size() - 8) {
    throw fail(Fault::truncated_header, "header length " + std::to_string(n) + " but only " +
                                            std::to_string(bytes.size() - 8) +
                                            " bytes follow the length");
  }
  const std::string_view text = bytes.substr(8, n);
  const std::string_view data = bytes.substr(8 + n);
  if (!valid_utf8(text)) throw fail(Fault::not_utf8, "the header is not valid UTF-8");
  if (text.empty() || text.front() != '{') {
    throw fail(Fault::header_start, text.empty() ? "the header is empty"
                                                 : "the header begins with byte " +
                                                       std::to_string(uint8_t(text.front())));
  }
  // Depth 3: root object -> tensor entry -> shape / data_offsets arrays.
  const json header = parse_json_strict(text, source, "header", 3, 64);
  if (!header.is_object()) throw fail(Fault::bad_json, "the header is not a JSON object");

  File file;
  file.header_len = n;
  std::vector<Entry> entries;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw fail(Fault::bad_metadata, "__metadata__ is " + json_kind(v));
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) {
          throw fail(Fault::bad_metadata,
                     "__metadata__ value of '" + k + "' is " + json_kind(s) + ", not a string");
        }
        file.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (name.empty()) throw fail(Fault::bad_entry, "empty tensor name");
    if (!v.is_object()) throw fail(Fault::bad_entry, what + " is " + json_kind(v));
    for (auto& [k, x] : v.items()) {
      if (k != "dtype" && k != "shape" && k != "data_offsets") {
        throw fail(Fault::bad_entry, what + " has unknown field '" + k + "'");
      }
    }
    for (const char* k : {"dtype", "shape", "data_offsets"}) {
      if (!v.contains(k)) throw fail(Fault::bad_entry, what + " has no '" + k + "'");
    }
    Entry e;
    e.name = name;
    const json& dt = v["dtype"];
    if (!dt.is_string()) throw fail(Fault::bad_entry, what + ": dtype is " + json_kind(dt));
    const std::string code = dt.get<std::string>();
    const auto parsed = parse_dtype_code(code);
    if (!parsed) {
      const bool known = std::find(std::begin(kDisallowedCodes), std::end(kDisallowedCodes),
                                   code) != std::end(kDisallowedCodes);
      throw fail(Fault::unknown_dtype,
                 what + ": dtype '" + code + "'" +
                     (known ? " is not allowed by moe-golden/1 (store i16 as I32)"
                            : " is not one of F64 F32 BF16 F16 I64 I32 U8 BOOL"));
    }
    e.dtype = *parsed;
    const json& sh = v["shape"];
    if (!sh.is_array()) throw fail(Fault::bad_entry, what + ": shape is " + json_kind(sh));
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < sh.size(); ++i) {
      const json& d = sh[i];
      if (!d.is_number_unsigned()) {
        throw fail(Fault::bad_number,
                   what + ": shape[" + std::to_string(i) + "] is " + json_kind(d));
      }
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw fail(Fault::shape_overflow, what + ": shape[" + std::to_string(i) +
                                              "] = " + std::to_string(dim) + " exceeds int64");
      }
      e.shape.push_back(static_cast<int64_t>(dim));
      // Left fold with overflow check, as the safetensors crate and shape_numel() do.
      if (dim != 0 && numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim) {
        overflow = true;
      }
      numel *= dim;
    }
    const uint64_t size = dtype_size(e.dtype);
    if (overflow || numel > std::numeric_limits<uint64_t>::max() / size) {
      throw fail(Fault::shape_overflow,
                 what + ": shape " + shape_str(e.shape) + " of " + code + " overflows");
    }
    const uint64_t nbytes = numel * size;
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) {
      throw fail(Fault::bad_entry, what + ": data_offsets is not a [begin, end] pair");
    }
    for (size_t i = 0; i < 2; ++i) {
      if (!off[i].is_number_unsigned()) {
        throw fail(Fault::bad_number,
                   what + ": data_offsets[" + std::to_string(i) + "] is " + json_kind(off[i]));
      }
    }
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    const std::string range = "[" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.end < e.begin) {
      throw fail(Fault::offsets_not_contiguous, what + ": data_offsets " + range + " end first");
    }
    if (e.end - e.begin != nbytes) {
      throw fail(Fault::length_mismatch,
                 what + ": data_offsets " + range + " hold " + std::to_string(e.end - e.begin) +
                     " bytes, " + code + shape_str(e.shape) + " needs " + std::to_string(nbytes));
    }
    if (e.end > data.size()) {
      throw fail(Fault::offsets_out_of_range, what + ": data_offsets " + range +
                                                  " beyond the data buffer of " +
                                                  std::to_string(data.size()) + " bytes");
    }
    entries.push_back(std::move(e));
  }

  // Contiguity in offset order, as the safetensors crate checks it (entries may be listed in any
  // order; the writer uses name order).
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < covered) {
      throw fail(Fault::offsets_not_contiguous, "tensor '" + e.name + "' begins at " +
                                                    std::to_string(e.begin) + ", inside tensor '" +
                                                    prev->name + "' (ends at " +
                                                    std::to_string(covered) + ")");
    }
    if (e.begin > covered) {
      throw fail(Fault::offsets_not_contiguous, "bytes [" + std::to_string(covered) + ", " +
                                                    std::to_string(e.begin) + ") before tensor '" +
                                                    e.name + "' belong to no tensor");
    }
    covered = e.end;
    prev = &e;
  }
  if (covered != data.size()) {
    throw fail(Fault::buffer_size_mismatch, "the data buffer has " + std::to_string(data.size()) +
                                                " bytes, the tensors cover " +
                                                std::to_string(covered));
  }

  for (Entry& e : entries) {
    Tensor t(e.dtype, e.shape);
    if (t.nbytes()) std::memcpy(t.bytes(), data.data() + e.begin, t.nbytes());
    if (e.dtype == DType::boolean) {
      const auto* b = reinterpret_cast<const uint8_t*>(t.bytes());
      for (size_t i = 0; i < t.nbytes(); ++i) {
        if (b[i] > 1) {
          throw fail(Fault::bad_bool, "tensor '" + e.name + "' element " + std::to_string(i) +
                                          " is byte " + std::to_string(b[i]) + ", not 0 or 1");
        }
      }
    }
    file.tensors.emplace(e.name, std::move(t));
  }
  return file;
}

}  // namespace moe::golden

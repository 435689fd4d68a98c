// The moe-golden/1 schema (SPEC §14): which tensors and params keys each op's file holds, and
// the checks of a file's metadata, params string and tensor names against it. The table is the
// SPEC's, independent of the registry, so a file of an op this build does not implement is still
// checked (and the fuzz target needs no registry).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "golden/safetensors.h"

namespace moe::golden {

inline constexpr std::string_view kFormat = "moe-golden/1";

struct TensorSpec {
  std::string name;           // <n> of input.<n>, output.<n>, ...
  bool optional = false;      // "?" in the §14 table
  std::vector<DType> dtypes;  // allowed dtypes; empty = any stated by the op's section
};

enum class ParamKind : uint8_t { integer, number, boolean, string };

struct OpSchema {
  std::string op;
  std::vector<TensorSpec> inputs, outputs, cotangents, grads;
  std::vector<std::string> params;  // sorted
};

const std::vector<OpSchema>& op_schemas();  // every op of the §14 table, in SPEC order
const OpSchema* find_schema(std::string_view op);
ParamKind param_kind(const std::string& key);  // throws std::out_of_range for an unknown key

// What the metadata of a valid moe-golden/1 file says.
struct Header {
  std::string op;
  DType dtype = DType::f32;
  uint64_t seed = 0;
  std::string params_text;  // as stored (canonical)
  nlohmann::json params;    // parsed
  const OpSchema* schema = nullptr;
};

// Canonical params string of §14 (compact, sorted keys, floats with '.' or an exponent).
std::string format_params(const nlohmann::json& params);

// Checks format, op, dtype, seed, params (JSON without duplicates, exactly the op's keys, each of
// its kind or null, canonical form) and tensor names and dtypes. Throws FormatError(schema, ...)
// naming `source` and the fault.
Header check_schema(const File& file, const std::string& source);

// The required metadata keys plus any extra (x-) keys.
Metadata make_metadata(const std::string& op, DType dtype, uint64_t seed,
                       const nlohmann::json& params, const Metadata& extra = {});

}  // namespace moe::golden

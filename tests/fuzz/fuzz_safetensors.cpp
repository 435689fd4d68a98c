// libFuzzer target for the golden-file reader (golden/safetensors.h, golden/schema.h).
//
// Contract under test: for ANY byte string, parse() either returns a File or throws FormatError;
// it never crashes, reads out of bounds (ASan), hits undefined behaviour (UBSan) or throws
// anything else. What it accepts must survive serialize() -> parse() unchanged, and the schema
// check of an accepted file may only fail with Fault::schema.
//
// Build: cmake -DMOE_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ (see docs/golden.md), then
//   moe_fuzz_safetensors -dict=tests/fuzz/safetensors.dict -max_total_time=600 CORPUS_DIR
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "golden/safetensors.h"
#include "golden/schema.h"

namespace {

[[noreturn]] void fail() {
  __builtin_trap();
}

void check_round_trip(const moe::golden::File& f) {
  const std::string again = moe::golden::serialize(f.tensors, f.metadata);
  const moe::golden::File g = moe::golden::parse(again, "fuzz-roundtrip");
  if (g.metadata != f.metadata || g.tensors.size() != f.tensors.size()) fail();
  if (g.header_len % 8 != 0) fail();
  for (auto& [name, t] : f.tensors) {
    auto it = g.tensors.find(name);
    if (it == g.tensors.end() || !it->second.bitwise_equal(t)) fail();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  moe::golden::File f;
  try {
    f = moe::golden::parse(bytes, "fuzz-input");
  } catch (const moe::golden::FormatError&) {
    return 0;
  }
  check_round_trip(f);
  try {
    moe::golden::check_schema(f, "fuzz-input");
  } catch (const moe::golden::FormatError& e) {
    if (e.fault() != moe::golden::Fault::schema) fail();
  }
  return 0;
}

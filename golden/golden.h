// The golden-file tool (`moe-harness golden ...`): record the named case catalogue through the
// reference into moe-golden/1 files, verify files by recomputing them from their stored inputs
// with the SPEC §12 tolerances of each op's registry record, diff two files tensor by tensor, and
// show one file. Needs the registry (moe_ops); the format itself is golden/safetensors.h.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "golden/safetensors.h"
#include "golden/schema.h"
#include "harness/core/case.h"
#include "moe_harness/impl.h"

namespace moe::golden {

// ---- record ----

// The catalogue: every named() case of every registered op, or of `op` alone (throws
// std::invalid_argument naming an unknown op).
std::vector<Case> catalogue(const std::string& op = "");

// "<op>__<name>__<dtype>.safetensors" (name = the case's "name" param, else "case").
std::string file_name(const Case& c);

// The x- metadata of a file written by this build (x-generator, x-git, x-backend, x-device,
// x-toolkit, x-case).
Metadata provenance(const Case& c);

// Runs c through the reference: input.* and cotangent.* from the generator, output.* and grad.*
// from the reference. Throws on any fault (unknown op, a file the schema would reject).
struct Recorded {
  TensorMap tensors;
  Metadata metadata;
  size_t bytes() const;
};
Recorded record_case(const Case& c);

struct RecordOptions {
  std::string out_dir;
  std::string op;          // restrict the catalogue to one op
  std::string case_line;   // record this one case instead of the catalogue
  uint64_t max_bytes = 0;  // skip catalogue cases whose tensors exceed this (0 = no limit)
};
// Writes one file per case; returns the process status (0 ok, 1 a case failed). Logs to `log`.
int record(const RecordOptions& o, std::ostream& log);

// ---- verify ----

struct VerifyResult {
  std::string path, op, dtype;
  std::string verdict;  // PASS, FAIL (tolerance or invariant), ERROR (unreadable, unverifiable)
  double worst_pct = 0;
  std::string report;  // mismatch report or error message
  std::string replay;  // commands that replay the case
  double seconds = 0;
  bool ok() const { return verdict == "PASS"; }
};

// Files named directly, and every *.safetensors under a directory (sorted).
std::vector<std::string> expand_paths(const std::vector<std::string>& paths);
// backend: an implementation name (reference, moe-gpu or a registered one; "gpu" = moe-gpu).
VerifyResult verify_file(const std::string& path, const std::string& backend,
                         TiePolicy ties = TiePolicy::canonical);
// Verifies every file, prints the table and the failure reports; writes JUnit XML when junit is
// non-empty. Returns 0 when every file passes, 1 otherwise, 2 for --backend gpu without a GPU.
int verify(const std::vector<std::string>& paths, const std::string& backend,
           const std::string& junit, std::ostream& out, TiePolicy ties = TiePolicy::canonical);
std::string junit_xml(const std::vector<VerifyResult>& results);

// ---- diff / show ----

// Tensor-by-tensor comparison: per tensor max abs/rel error, ULP distance histogram, first and
// worst mismatch with coordinates. Returns 0 if the files hold bitwise-equal tensors and equal
// non-x- metadata, 1 if they differ, 2 if one cannot be read.
int diff(const std::string& a, const std::string& b, std::ostream& out);
// Metadata and per-tensor summary (dtype, shape, min/max/mean, NaN/Inf counts). 0, or 2 if the
// file cannot be read.
int show(const std::string& path, std::ostream& out);

// ULP distance of two values of a float dtype, from their bit patterns (±0 are 0 apart); the
// caller handles NaN.
uint64_t ulp_distance(DType dt, const std::byte* a, const std::byte* b);

}  // namespace moe::golden

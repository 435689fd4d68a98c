// Implementations: the harness's second axis next to the ops. For an op (SPEC name) any number
// of named implementations are registered: `reference` (the CPU reference), `moe-gpu` (this
// project's CUDA twins), and whatever a user registers from C++ (register_impl), from a shared
// library (moe_harness/plugin.h, `moe-harness check --plugin`) or from Python. `moe-harness
// check --impl NAME` and check_impl() run every named and random case of an op through one
// implementation and compare it with the reference under SPEC §12's bounds.
//
// What an implementation sees: the case (parameters; `c.line()` replays it), its inputs
// (input.* and cotangent.*, SPEC §14 names) and its output buffers (output.* and grad.*), already
// allocated with the dtype and shape SPEC gives them and filled with poison (0xFF bytes: NaN for
// floats, 0xFF for integers and maps) so an element it leaves unwritten fails. Guard bytes after
// every output buffer catch writes past its end. Tensors are on the host or on the current CUDA
// device, as the implementation chooses; every call is made twice and both results must be
// bitwise equal (determinism), unless the implementation says it is not deterministic.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "harness/core/case.h"
#include "harness/core/tensor.h"

namespace moe {

// Where an implementation wants its tensors.
enum class Memory : uint8_t { host, cuda };

// How exact ties of top-k selection may be broken (SPEC §1.4). Near ties (a margin within the
// fp32 noise of two implementations) are accepted under every policy.
enum class TiePolicy : uint8_t {
  canonical,  // value descending, index ascending (SPEC §1.4; jax.lax.top_k, TE's radix path)
  te,         // TE's naive path for K < 16 or E > 8160 (winner minimises (rev5(i%32), i/32)),
              // the canonical rule otherwise (TE's radix path)
  any,        // any valid top-k set among exactly tied candidates
};
std::string_view tie_policy_name(TiePolicy p);
TiePolicy parse_tie_policy(std::string_view s);  // throws std::invalid_argument naming the value

// Rows of an output that SPEC leaves to the implementation (SPEC §0 "Unwritten rows"): this
// project writes zeros there; TE leaves some uninitialised, and SPEC says a comparison against
// TE must mask them. `te` masks exactly the rows SPEC lists: token_dispatch's row_id_map entries
// past each token's count (§4.2) and, without padding, the tail rows past the routed ones
// (§4.3); token_combine without padding and merging probs, the rows of grad.permuted no routed
// slot owns (§5; with merging probs SPEC demands zeros, R4). Masked rows are not compared, in
// either run, and a note counts them.
enum class UnwrittenRows : uint8_t { zeros, te };
std::string_view unwritten_rows_name(UnwrittenRows u);
UnwrittenRows parse_unwritten_rows(std::string_view s);  // throws std::invalid_argument

// DLPack 0.6 (Debian's libdlpack-dev) has no bool code; this is DLPack >= 0.8's kDLBool, which
// PyTorch, JAX and CuPy also use. Bool tensors (routing maps) are 1 byte per element, 0 or 1.
inline constexpr uint8_t kMoeDLBool = 6;

// DLPack views of one call's tensors, keyed by SPEC §14 name. Every view is compact row-major
// (strides null) and its memory belongs to the harness.
using TensorViews = std::map<std::string, DLTensor>;

struct ImplCall {
  const Case& c;
  std::string params_json;             // SPEC §14 `params` of the case (compact, sorted keys)
  const TensorViews& in;               // input.*, cotangent.* (read only)
  const TensorViews& out;              // output.*, grad.*: poisoned, to be written
  const TensorMap* host_in = nullptr;  // the inputs as moe::Tensors (host copies, any memory)
  void* stream = nullptr;  // Memory::cuda: the cudaStream_t to launch on (null = default stream)
};

// Thrown by an implementation (or raised through the plugin ABI's status code) to say that it
// does not support a case: the case is reported NotSupported, not failed.
struct NotSupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Impl {
  std::string op;      // SPEC op name
  std::string name;    // "reference", "moe-gpu", "te", "mine", ...
  std::string origin;  // "built-in", "C++", "plugin /path/libx.so", "python"
  Memory memory = Memory::host;
  bool deterministic = true;  // false: the two-run bitwise comparison is reported, not failed
  UnwrittenRows unwritten = UnwrittenRows::zeros;  // te: SPEC's TE-unwritten rows not compared
  // The output.* and grad.* keys it writes; the others are not compared. Empty: all of them.
  std::vector<std::string> provides;
  // Empty when c is supported, else why not (NotSupported). Optional; run may also throw
  // NotSupported.
  std::function<std::string(const Case&)> unsupported;
  // Writes every provided output into call.out. Throws on an error (reported as a failure).
  std::function<void(const ImplCall&)> run;
  // Built-in implementations that allocate and poison their own buffers (the reference and the
  // CUDA twins) give host tensors back instead of writing call.out; run is then unset.
  std::function<TensorMap(const Case&, const TensorMap& in)> run_owned;
  // Calls into this implementation are serialised (a GPU implementation, non-reentrant code);
  // the harness still prepares cases in parallel under `-j N`.
  bool serial = true;
  std::shared_ptr<void> keepalive;  // e.g. the plugin's library handle
};

// Registers impl for its op. Throws std::invalid_argument when the op is unknown, the name is
// empty or has a space, or (op, name) is already registered.
void register_impl(Impl impl);
// Every registered implementation of op (every op when op is empty), built-ins first.
std::vector<const Impl*> impls(std::string_view op = {});
const Impl* find_impl(std::string_view op, std::string_view name);  // null if none
// The distinct implementation names, built-ins first, then in registration order.
std::vector<std::string> impl_names();

// Loads a plugin (moe_harness/plugin.h) with dlopen and registers each of its ops; returns the
// implementation name. Throws std::invalid_argument naming the path and the fault (not loadable,
// a missing symbol, another ABI version, a malformed descriptor, an unknown op).
std::string load_plugin(const std::string& path);

// Convenience for a host implementation written against moe::Tensor: fn reads `in` and writes
// the (poisoned) tensors of `out`.
Impl host_impl(std::string op, std::string name,
               std::function<void(const Case& c, const TensorMap& in, TensorMap& out)> fn);

// ---- running the checks ----

inline constexpr int kMinRuns = 2, kMaxRuns = 10000;

struct CheckOptions {
  int cases = 20;     // random cases per op (plus the named ones unless named = false)
  uint64_t seed = 1;  // seed of the random cases
  bool named = true;  // run the op's named cases (SPEC R* regressions, the catalogue)
  TiePolicy ties = TiePolicy::canonical;
  bool shrink = true;        // shrink a failing random case to a minimal failing one
  int jobs = 1;              // cases prepared and compared in parallel (CPU side)
  std::string replay_extra;  // flags the replay line carries (e.g. "--plugin /p/libx.so")
  // Calls of the implementation per case (kMinRuns..kMaxRuns): every call after the first must
  // give its bits (a deterministic implementation). More than 2 hunts races that show only now
  // and then; a case stops at the first call that differs.
  int runs = 2;
  // Seconds one call of the implementation may take (0: no limit, at most a day). A call past it
  // prints the case's replay line and ends the process with status 1: a hung call cannot be
  // abandoned. A call that dies of a fatal signal prints the replay line before the process dies,
  // with or without a timeout.
  double case_timeout_s = 0;
  bool keep_outputs = false;  // keep a failing case's outputs in CaseResult::outputs
  // Optional rewrite of every case (e.g. moe_block's cases to an EP size); nullopt drops a case.
  std::function<std::optional<Case>(const Case&)> rewrite;
};

enum class Verdict : uint8_t { passed, failed, not_supported };
std::string_view verdict_name(Verdict v);

struct CaseResult {
  Case c;  // the case as run (the shrunk one when shrinking found one)
  Verdict verdict = Verdict::passed;
  std::string report;  // mismatch report / failure lines (failed), reason (not_supported)
  std::vector<std::string> notes;  // e.g. rows resolved under a tie policy
  std::string replay;              // the command that replays c
  std::string original;            // the case line before shrinking (empty when not shrunk)
  double worst_pct = 0, seconds = 0;
  bool named = false;
  bool invalid_case = false;  // the case's own parameters were rejected (not a kernel fault)
  // The case left the CUDA context dead (a sticky error such as an illegal address): no later
  // CUDA call of this process can succeed, so the run stops after it (OpResult::aborted).
  bool context_lost = false;
  TensorMap outputs;  // CheckOptions::keep_outputs: what a failing implementation wrote
};

struct OpResult {
  std::string op, impl;
  std::vector<CaseResult> cases;
  int passed = 0, failed = 0, not_supported = 0;
  double worst_pct = 0, seconds = 0;
  std::vector<std::string> edge_classes;  // parameter edges the cases covered
  // A case killed the CUDA context (CaseResult::context_lost): the op's remaining cases were not
  // run (not_run of them) and nothing else on the GPU can run in this process.
  bool aborted = false;
  int not_run = 0;
  std::string disposition() const;  // Passed, Incorrect, NotSupported
};

// One case through impl: poisoned outputs, compared with the reference (tie-aware per
// opt.ties), run opt.runs times for determinism. Never throws for a fault of the implementation;
// throws std::invalid_argument for opt.runs outside kMinRuns..kMaxRuns.
CaseResult check_case(const Impl& impl, const Case& c, const CheckOptions& opt);
// Every named case and opt.cases random cases of impl's op. on_case, when set, is called after
// each case (in case order) from the calling thread.
OpResult check_impl(const Impl& impl, const CheckOptions& opt,
                    const std::function<void(const CaseResult&)>& on_case = {});

// The command that replays c through an implementation.
std::string replay_command(const Case& c, std::string_view impl, TiePolicy ties,
                           std::string_view extra = {});

}  // namespace moe

#include "golden/golden.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <sstream>

#include "harness/ops/check.h"
#include "harness/ops/impl_check.h"
#include "harness/ops/registry.h"

namespace moe::golden {

namespace fs = std::filesystem;

namespace {

std::string toolkit() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#else
  return "unknown C++ compiler";
#endif
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const bool ok =
        std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.';
    out += ok ? ch : '_';
  }
  return out.empty() ? "case" : out;
}

std::string hex8(const std::string& s) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char ch : s) h = (h ^ ch) * 16777619u;
  std::ostringstream o;
  o << std::hex << std::setw(8) << std::setfill('0') << h;
  return o.str();
}

bool starts_with(const std::string& s, const char* p) {
  return s.rfind(p, 0) == 0;
}

std::string fmt(double v, int prec = 4) {
  std::ostringstream o;
  o << std::setprecision(prec) << v;
  return o.str();
}

std::string coord_str(const std::vector<int64_t>& c) {
  std::string s = "(";
  for (size_t i = 0; i < c.size(); ++i) s += (i ? ", " : "") + std::to_string(c[i]);
  return s + ")";
}

// Raw value of element i for messages: floats as shortest round trip, integers exactly.
std::string value_str(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::i64) {
    int64_t v;
    std::memcpy(&v, t.bytes() + i * 8, 8);
    return std::to_string(v);
  }
  const double v = t.at(i);
  return is_floating(t.dtype()) ? format_double(v) : std::to_string(static_cast<int64_t>(v));
}

}  // namespace

// ---------------------------------------------------------------- record

std::vector<Case> catalogue(const std::string& op) {
  std::vector<Case> out;
  if (!op.empty() && !ops::find_op(op)) {
    throw std::invalid_argument("--op: unknown op '" + op + "'");
  }
  for (const ops::OpInfo* info : ops::all_ops()) {
    if (!op.empty() && info->name != op) continue;
    if (!info->named) continue;
    for (Case& c : info->named()) out.push_back(std::move(c));
  }
  return out;
}

std::string file_name(const Case& c) {
  return sanitize(c.op) + "__" + sanitize(c.s("name", "case")) + "__" +
         std::string(dtype_name(c.dtype)) + ".safetensors";
}

Metadata provenance(const Case& c) {
  return {
      {"x-generator", std::string("moe-harness ") + MOE_VERSION},
      {"x-git", MOE_GIT_REV},
      {"x-backend", "reference"},
      {"x-device", "cpu (Eigen reference, fp64 compute)"},
      {"x-toolkit", toolkit()},
      {"x-case", c.line()},
  };
}

size_t Recorded::bytes() const {
  size_t n = 0;
  for (auto& [k, t] : tensors) n += t.nbytes();
  return n;
}

Recorded record_case(const Case& c) {
  const ops::OpInfo* op = ops::find_op(c.op);
  if (!op) throw std::invalid_argument("case: op '" + c.op + "' is not registered");
  if (!op->to_params) throw std::invalid_argument("op " + c.op + " has no to_params (SPEC §14)");
  Recorded r;
  r.tensors = op->make_inputs(c);
  TensorMap out = op->reference(c, r.tensors, false);
  for (auto& [k, t] : out) {
    if (!starts_with(k, "output.") && !starts_with(k, "grad.")) {
      throw std::logic_error("op " + c.op + ": reference returned '" + k +
                             "', not output.* or grad.*");
    }
    if (!r.tensors.emplace(k, std::move(t)).second) {
      throw std::logic_error("op " + c.op + ": tensor '" + k + "' produced twice");
    }
  }
  r.metadata = make_metadata(c.op, c.dtype, c.seed, op->to_params(c), provenance(c));
  // Never write a file our own reader would reject.
  File f;
  f.metadata = r.metadata;
  for (auto& [k, t] : r.tensors) f.tensors.emplace(k, t.clone());
  check_schema(f, file_name(c));
  return r;
}

int record(const RecordOptions& o, std::ostream& log) {
  std::vector<Case> cases;
  if (!o.case_line.empty()) {
    cases.push_back(Case::parse(o.case_line));
  } else {
    cases = catalogue(o.op);
  }
  fs::create_directories(o.out_dir);
  std::set<std::string> names;
  int written = 0, skipped = 0, failed = 0;
  size_t total = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const Case& c : cases) {
    try {
      Recorded r = record_case(c);
      if (o.max_bytes && o.case_line.empty() && r.bytes() > o.max_bytes) {
        log << "skipped (" << r.bytes() << " B > --max-bytes " << o.max_bytes << "): " << c.line()
            << "\n";
        ++skipped;
        continue;
      }
      std::string name = file_name(c);
      if (!names.insert(name).second) {  // two catalogue cases with one name and dtype
        name = name.substr(0, name.size() - std::string(".safetensors").size()) + "__" +
               hex8(c.line()) + ".safetensors";
        names.insert(name);
      }
      const std::string path = (fs::path(o.out_dir) / name).string();
      write_file(path, r.tensors, r.metadata);
      total += r.bytes();
      ++written;
      log << "wrote " << path << " (" << r.bytes() << " B)\n";
    } catch (const std::exception& e) {
      ++failed;
      log << "FAILED: " << c.line() << "\n  " << e.what() << "\n";
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log << "golden record: " << written << " written (" << total << " tensor bytes), " << skipped
      << " skipped, " << failed << " failed in " << fmt(s, 3) << " s\n";
  return failed ? 1 : 0;
}

// ---------------------------------------------------------------- verify

std::vector<std::string> expand_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (auto& e : fs::recursive_directory_iterator(p)) {
        if (e.is_regular_file() && e.path().extension() == ".safetensors") {
          found.push_back(e.path().string());
        }
      }
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
    } else {
      out.push_back(p);  // a missing file becomes an ERROR row, not a silent skip
    }
  }
  return out;
}

namespace {

// The file's params with every null (SPEC §14: an absent optional parameter) replaced by what the
// op's to_params gives for the rebuilt case, so a null matches the parameter's default.
nlohmann::json resolve_nulls(const nlohmann::json& stored, const nlohmann::json& expect) {
  nlohmann::json out = stored;
  for (auto& [k, v] : out.items())
    if (v.is_null() && expect.contains(k)) v = expect.at(k);
  return out;
}

std::string null_keys(const nlohmann::json& params) {
  std::string s;
  for (auto& [k, v] : params.items())
    if (v.is_null()) s += (s.empty() ? "" : ", ") + k;
  return s;
}

}  // namespace

VerifyResult verify_file(const std::string& path, const std::string& backend, TiePolicy ties) {
  VerifyResult r;
  r.path = path;
  r.verdict = "ERROR";
  const auto t0 = std::chrono::steady_clock::now();
  auto done = [&]() -> VerifyResult& {
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  const std::string impl_name = backend == "gpu" ? "moe-gpu" : backend;
  const std::string verify_line =
      "moe-harness golden verify --impl " + impl_name +
      (ties != TiePolicy::canonical ? " --ties " + std::string(tie_policy_name(ties))
                                    : std::string()) +
      " " + path;
  r.replay = verify_line;
  try {
    const File f = read_file(path);
    const Header h = check_schema(f, path);
    r.op = h.op;
    r.dtype = std::string(dtype_name(h.dtype));
    const ops::OpInfo* op = ops::find_op(h.op);
    if (!op) throw std::invalid_argument("op '" + h.op + "' is not registered in this build");
    if (!op->from_params || !op->to_params) {
      throw std::invalid_argument("op " + h.op + " has no from_params/to_params");
    }
    TensorMap in, want;
    bool backward = false;
    for (auto& [k, t] : f.tensors) {
      backward |= starts_with(k, "cotangent.");
      (starts_with(k, "input.") || starts_with(k, "cotangent.") ? in : want).emplace(k, t.clone());
    }
    // The case: our own files carry their exact Case line (generator knobs included, which no
    // file stores); any other file is rebuilt from params, dtype, seed and the stored inputs.
    // Either way the op's to_params must give back the stored params (a null stored value, an
    // absent optional parameter, matches whatever the rebuilt case has).
    Case c;
    auto x = f.metadata.find("x-case");
    const bool own_case = x != f.metadata.end();
    if (own_case) {
      c = Case::parse(x->second);
      if (c.op != h.op || c.dtype != h.dtype || c.seed != h.seed) {
        throw std::invalid_argument("x-case '" + x->second + "' disagrees with op/dtype/seed");
      }
    } else {
      try {
        c = op->from_params(h.params, h.dtype, h.seed, in);
      } catch (const nlohmann::json::exception& e) {
        // check_schema has checked every key's kind, so this is a null the op cannot default.
        const std::string nulls = null_keys(h.params);
        throw std::invalid_argument("params of " + h.op + ": " +
                                    (nulls.empty() ? std::string(e.what())
                                                   : "null " + nulls + ", and " + h.op +
                                                         " has no default for one of them (" +
                                                         e.what() + ")"));
      }
    }
    const Impl* impl = find_impl(h.op, impl_name);
    if (!impl) throw std::invalid_argument("no implementation '" + impl_name + "' of " + h.op);
    // A file without x-case replays only as itself: a `check --case` line would regenerate
    // other inputs from the seed.
    if (own_case) r.replay = replay_command(c, impl_name, ties) + "\n    " + verify_line;
    const nlohmann::json expect = op->to_params(c);
    const std::string params = format_params(expect);
    if (format_params(resolve_nulls(h.params, expect)) != params) {
      throw std::invalid_argument("params '" + h.params_text +
                                  "' differ from the op's to_params '" + params + "'");
    }
    if (impl->unsupported) {
      const std::string why = impl->unsupported(c);
      if (!why.empty()) throw std::runtime_error(impl_name + " does not support this case: " + why);
    }
    // What the op's bounds read but the file may lack: the cotangents of a forward-only file
    // (SPEC §14; its grads are then neither produced nor compared), and outputs a file leaves
    // out (TE's router returns no saved_scores). They come from the case's generator and the
    // reference, and only what the file holds is compared.
    if (!backward) {
      for (auto& [k, t] : op->make_inputs(c))
        if (starts_with(k, "cotangent.") && !in.count(k)) in.emplace(k, t.clone());
    }
    std::set<std::string> filled;
    if (h.schema) {
      std::vector<std::string> missing;
      for (auto& spec : h.schema->outputs)
        if (!want.count("output." + spec.name)) missing.push_back("output." + spec.name);
      if (!missing.empty()) {
        TensorMap ref = op->reference(c, in, false);
        for (auto& k : missing) {
          auto it = ref.find(k);
          if (it == ref.end()) continue;
          want.emplace(k, std::move(it->second));
          filled.insert(k);
        }
      }
    }
    // The implementation's outputs (poisoned buffers, two runs) against the file's. A built-in
    // implementation computes every output; a forward-only file's check drops its gradients.
    Impl run = *impl;
    if (!backward && run.run_owned) {
      run.run_owned = [inner = run.run_owned](const Case& cc, const TensorMap& ii) {
        TensorMap m = inner(cc, ii);
        std::erase_if(m, [](const auto& kv) { return kv.first.rfind("grad.", 0) == 0; });
        return m;
      };
    }
    std::vector<std::string> notes;
    Report rep = ops::compare_impl(run, c, in, want, ties, notes);
    if (!filled.empty()) {
      std::erase_if(rep.tensors, [&](const TensorReport& t) { return filled.count(t.name) > 0; });
      std::string keys;
      for (auto& k : filled) keys += (keys.empty() ? "" : ", ") + k;
      notes.push_back("not in the file, not compared: " + keys);
    }
    if (!backward) notes.push_back("forward-only file: gradients not compared");
    r.worst_pct = rep.worst_pct();
    r.verdict = rep.ok() ? "PASS" : "FAIL";
    if (!rep.ok()) {
      r.report = rep.str();
      for (auto& n : notes) r.report += "  note: " + n + "\n";
    }
  } catch (const std::exception& e) {
    r.verdict = "ERROR";
    r.report = std::string("  ") + e.what() + "\n";
  }
  return done();
}

std::string junit_xml(const std::vector<VerifyResult>& results) {
  int failures = 0, errors = 0;
  double total = 0;
  for (auto& r : results) {
    failures += r.verdict == "FAIL";
    errors += r.verdict == "ERROR";
    total += r.seconds;
  }
  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o << "<testsuites tests=\"" << results.size() << "\" failures=\"" << failures << "\" errors=\""
    << errors << "\" time=\"" << total << "\">\n";
  o << "  <testsuite name=\"golden_verify\" tests=\"" << results.size() << "\" failures=\""
    << failures << "\" errors=\"" << errors << "\" time=\"" << total << "\">\n";
  for (auto& r : results) {
    o << "    <testcase classname=\"golden." << xml_escape(r.op.empty() ? "unknown" : r.op)
      << "\" name=\"" << xml_escape(fs::path(r.path).filename().string()) << "\" time=\""
      << r.seconds << "\">\n";
    if (!r.ok()) {
      const char* tag = r.verdict == "FAIL" ? "failure" : "error";
      std::string first_line = r.report.substr(0, r.report.find('\n'));
      first_line.erase(0, first_line.find_first_not_of(' '));
      o << "      <" << tag << " message=\"" << xml_escape(first_line) << "\">"
        << xml_escape(r.report + "replay: " + r.replay) << "</" << tag << ">\n";
    }
    o << "      <system-out>"
      << xml_escape(r.path + ": worst " + fmt(r.worst_pct) + "% of tolerance") << "</system-out>\n";
    o << "    </testcase>\n";
  }
  o << "  </testsuite>\n</testsuites>\n";
  return o.str();
}

int verify(const std::vector<std::string>& paths, const std::string& backend,
           const std::string& junit, std::ostream& out, TiePolicy ties) {
  if ((backend == "gpu" || backend == "moe-gpu") && !ops::gpu_available()) {
    // Same convention as `moe-harness check`: no GPU is a usage error, not 100 failed files.
    out << "golden verify --impl moe-gpu: no CUDA GPU: " << ops::gpu_description() << "\n";
    return 2;
  }
  const std::vector<std::string> names = impl_names();
  const std::string impl_name = backend == "gpu" ? "moe-gpu" : backend;
  if (std::find(names.begin(), names.end(), impl_name) == names.end()) {
    out << "golden verify --impl: no implementation named '" << impl_name << "'\n";
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> files = expand_paths(paths);
  std::vector<VerifyResult> results;
  size_t width = 4;
  for (auto& f : files) width = std::max(width, f.size());
  out << std::left << std::setw(static_cast<int>(width)) << "file"
      << "  " << std::setw(32) << "op" << std::setw(10) << "dtype" << std::right << std::setw(12)
      << "worst %tol"
      << "  verdict\n";
  for (auto& f : files) {
    results.push_back(verify_file(f, backend, ties));
    const VerifyResult& r = results.back();
    out << std::left << std::setw(static_cast<int>(width)) << f << "  " << std::setw(32)
        << (r.op.empty() ? "?" : r.op) << std::setw(10) << (r.dtype.empty() ? "?" : r.dtype)
        << std::right << std::setw(12) << fmt(r.worst_pct) << "  " << r.verdict << "\n";
  }
  int passed = 0;
  for (auto& r : results) {
    if (r.ok()) {
      ++passed;
      continue;
    }
    out << "\n"
        << r.verdict << " " << r.path << " (" << (r.op.empty() ? "?" : r.op) << ")\n"
        << r.report << "  replay: " << r.replay << "\n";
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int failed = static_cast<int>(results.size()) - passed;
  if (files.empty()) out << "golden verify: no .safetensors files under the given paths\n";
  out << "golden verify (" << backend << "): " << passed << " passed, " << failed << " failed in "
      << fmt(s, 3) << " s\n";
  if (!junit.empty()) {
    std::ofstream j(junit);
    j << junit_xml(results);
    if (!j) {
      out << "cannot write " << junit << "\n";
      return 1;
    }
  }
  return (failed || files.empty()) ? 1 : 0;
}

// ---------------------------------------------------------------- diff / show

uint64_t ulp_distance(DType dt, const std::byte* a, const std::byte* b) {
  // Maps sign-magnitude bits to a monotonic integer line (±0 both to 0).
  auto key = [&](const std::byte* p) -> int64_t {
    switch (dt) {
      case DType::f64: {
        uint64_t u;
        std::memcpy(&u, p, 8);
        const auto mag = static_cast<int64_t>(u & 0x7FFFFFFFFFFFFFFFull);
        return (u >> 63) ? -mag : mag;
      }
      case DType::f32: {
        uint32_t u;
        std::memcpy(&u, p, 4);
        const int64_t mag = u & 0x7FFFFFFFu;
        return (u >> 31) ? -mag : mag;
      }
      case DType::bf16:
      case DType::f16: {
        uint16_t u;
        std::memcpy(&u, p, 2);
        const int64_t mag = u & 0x7FFFu;
        return (u >> 15) ? -mag : mag;
      }
      default:
        throw std::invalid_argument("ulp_distance: dtype " + std::string(dtype_name(dt)) +
                                    " is not a float");
    }
  };
  const int64_t ka = key(a), kb = key(b);
  return ka >= kb ? static_cast<uint64_t>(ka) - static_cast<uint64_t>(kb)
                  : static_cast<uint64_t>(kb) - static_cast<uint64_t>(ka);
}

namespace {

struct TensorDiff {
  int64_t count = 0, mismatches = 0;
  double max_abs = 0, max_rel = 0;
  int64_t first = -1, worst = -1;
  // ULP histogram buckets: 0 (±0), 1, 2, 3-4, 5-16, 17-256, 257-65536, >65536, NaN.
  int64_t hist[9] = {};
};

constexpr const char* kBuckets[9] = {"0(+-0)", "1",       "2",    "3-4", "5-16",
                                     "17-256", "257-64K", ">64K", "NaN"};

int bucket(uint64_t d) {
  if (d == 0) return 0;
  if (d == 1) return 1;
  if (d == 2) return 2;
  if (d <= 4) return 3;
  if (d <= 16) return 4;
  if (d <= 256) return 5;
  if (d <= 65536) return 6;
  return 7;
}

TensorDiff diff_tensor(const Tensor& a, const Tensor& b) {
  TensorDiff d;
  d.count = a.numel();
  const size_t w = dtype_size(a.dtype());
  const bool fl = is_floating(a.dtype());
  double worst_key = -1;
  for (int64_t i = 0; i < d.count; ++i) {
    const std::byte* pa = a.bytes() + i * w;
    const std::byte* pb = b.bytes() + i * w;
    if (std::memcmp(pa, pb, w) == 0) continue;
    ++d.mismatches;
    if (d.first < 0) d.first = i;
    const double va = a.at(i), vb = b.at(i);
    double key;
    if (fl && (std::isnan(va) || std::isnan(vb))) {
      ++d.hist[8];
      key = std::numeric_limits<double>::infinity();
    } else {
      const double abs = std::fabs(va - vb);
      if (std::isfinite(abs)) {
        d.max_abs = std::max(d.max_abs, abs);
        if (vb != 0) d.max_rel = std::max(d.max_rel, abs / std::fabs(vb));
      }
      if (fl) {
        const uint64_t u = ulp_distance(a.dtype(), pa, pb);
        ++d.hist[bucket(u)];
        key = static_cast<double>(u);
      } else {
        key = abs;
      }
    }
    if (key > worst_key) {
      worst_key = key;
      d.worst = i;
    }
  }
  return d;
}

}  // namespace

int diff(const std::string& pa, const std::string& pb, std::ostream& out) {
  File a, b;
  try {
    a = read_file(pa);
    b = read_file(pb);
  } catch (const FormatError& e) {
    out << e.what() << "\n";
    return 2;
  }
  int differences = 0;
  std::set<std::string> keys;
  for (auto& [k, v] : a.metadata) keys.insert(k);
  for (auto& [k, v] : b.metadata) keys.insert(k);
  for (auto& k : keys) {
    auto ia = a.metadata.find(k), ib = b.metadata.find(k);
    const std::string va = ia == a.metadata.end() ? "(absent)" : ia->second;
    const std::string vb = ib == b.metadata.end() ? "(absent)" : ib->second;
    if (va == vb) continue;
    const bool provenance_key = starts_with(k, "x-");
    if (!provenance_key) ++differences;
    out << "metadata " << k << (provenance_key ? " (provenance)" : "") << ":\n  A: " << va
        << "\n  B: " << vb << "\n";
  }
  std::set<std::string> names;
  for (auto& [k, v] : a.tensors) names.insert(k);
  for (auto& [k, v] : b.tensors) names.insert(k);
  for (auto& n : names) {
    auto ia = a.tensors.find(n), ib = b.tensors.find(n);
    if (ia == a.tensors.end() || ib == b.tensors.end()) {
      ++differences;
      out << n << ": only in " << (ia == a.tensors.end() ? "B" : "A") << "\n";
      continue;
    }
    const Tensor &ta = ia->second, &tb = ib->second;
    if (ta.dtype() != tb.dtype() || ta.shape() != tb.shape()) {
      ++differences;
      out << n << ": A is " << ta.describe() << ", B is " << tb.describe() << "\n";
      continue;
    }
    const TensorDiff d = diff_tensor(ta, tb);
    if (d.mismatches == 0) {
      out << n << ": identical (" << ta.describe() << ")\n";
      continue;
    }
    ++differences;
    out << n << ": " << d.mismatches << " of " << d.count << " elements differ (" << ta.describe()
        << "); max abs err " << fmt(d.max_abs, 9) << ", max rel err " << fmt(d.max_rel, 9) << "\n";
    if (is_floating(ta.dtype())) {
      out << "  ulp histogram:";
      for (int k = 0; k < 9; ++k)
        if (d.hist[k]) out << " " << kBuckets[k] << ":" << d.hist[k];
      out << "\n";
    }
    auto line = [&](const char* what, int64_t i) {
      out << "  " << what << " at " << coord_str(unravel(i, ta.shape())) << ": A "
          << value_str(ta, i) << ", B " << value_str(tb, i);
      if (is_floating(ta.dtype()) && !std::isnan(ta.at(i)) && !std::isnan(tb.at(i))) {
        out << ", "
            << ulp_distance(ta.dtype(), ta.bytes() + i * dtype_size(ta.dtype()),
                            tb.bytes() + i * dtype_size(tb.dtype()))
            << " ulp";
      }
      out << "\n";
    };
    line("first", d.first);
    line("worst", d.worst);
  }
  out << (differences ? "files differ: " : "files match: ") << differences
      << " difference(s) outside provenance metadata\n";
  return differences ? 1 : 0;
}

int show(const std::string& path, std::ostream& out) {
  File f;
  try {
    f = read_file(path);
  } catch (const FormatError& e) {
    out << e.what() << "\n";
    return 2;
  }
  out << path << ": header " << f.header_len << " bytes, " << f.tensors.size() << " tensors\n";
  try {
    check_schema(f, path);
    out << "schema: valid " << kFormat << "\n";
  } catch (const FormatError& e) {
    out << "schema: " << e.detail() << "\n";
  }
  out << "metadata:\n";
  for (auto& [k, v] : f.metadata) out << "  " << k << ": " << v << "\n";
  size_t width = 6;
  for (auto& [k, t] : f.tensors) width = std::max(width, k.size());
  out << std::left << std::setw(static_cast<int>(width)) << "tensor"
      << "  " << std::setw(9) << "dtype" << std::setw(16) << "shape" << std::right << std::setw(14)
      << "min" << std::setw(14) << "max" << std::setw(14) << "mean" << std::setw(7) << "nan"
      << std::setw(7) << "inf"
      << "\n";
  for (auto& [k, t] : f.tensors) {
    double mn = std::numeric_limits<double>::infinity(), mx = -mn, sum = 0;
    int64_t nan = 0, inf = 0, finite = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = t.at(i);
      if (std::isnan(v)) {
        ++nan;
        continue;
      }
      if (std::isinf(v)) ++inf;
      mn = std::min(mn, v);
      mx = std::max(mx, v);
      if (std::isfinite(v)) {
        sum += v;
        ++finite;
      }
    }
    const bool any = t.numel() > nan;
    out << std::left << std::setw(static_cast<int>(width)) << k << "  " << std::setw(9)
        << dtype_code(t.dtype()) << std::setw(16) << shape_str(t.shape()) << std::right
        << std::setw(14) << (any ? fmt(mn, 6) : "-") << std::setw(14) << (any ? fmt(mx, 6) : "-")
        << std::setw(14) << (finite ? fmt(sum / static_cast<double>(finite), 6) : "-")
        << std::setw(7) << nan << std::setw(7) << inf << "\n";
  }
  return 0;
}

}  // namespace moe::golden

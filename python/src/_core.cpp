// moe_harness._core: the nanobind bindings behind the moe_harness Python package.
//
// The same registry the CLI uses (harness/ops/registry.h, include/moe_harness/impl.h): ops, their
// cases (the generator check_impl draws from, so `cases(op, n, seed)` are the cases
// `check(op, impl, cases=n, seed=seed)` runs), inputs and reference outputs as NumPy arrays, and
// check_case / check_impl over a Python implementation registered as a moe::Impl with
// memory = host. Its run() hands the call's DLPack views to Python as zero-copy NumPy arrays
// (inputs read-only; outputs the poisoned host buffers, guard bytes after them); the Python side
// (moe_harness/_frameworks.py) moves them to the framework and device and copies results back.
// Also the golden files: golden::write_file / read_file, make_metadata, check_schema,
// verify_file.
//
// Threading: check_impl runs with jobs = 1 on the calling thread with the GIL released; run()
// takes the GIL back for the Python call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <charconv>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "golden/golden.h"
#include "golden/safetensors.h"
#include "golden/schema.h"
#include "harness/ops/call_guard.h"
#include "harness/ops/case_validation.h"
#include "harness/ops/impl_buffers.h"
#include "harness/ops/registry.h"
#include "moe_harness/impl.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using moe::Case;
using moe::DType;
using moe::Tensor;
using moe::TensorMap;

// ---- parameters: Case values (strings) <-> Python values

nb::object param_value(const std::string& v) {
  if (v == "true") return nb::bool_(true);
  if (v == "false") return nb::bool_(false);
  int64_t i = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), i);
  if (r.ec == std::errc() && r.ptr == v.data() + v.size()) return nb::int_(i);
  if (v.find_first_of(".eEn") != std::string::npos) {
    double d = 0;
    auto rd = std::from_chars(v.data(), v.data() + v.size(), d);
    if (rd.ec == std::errc() && rd.ptr == v.data() + v.size()) return nb::float_(d);
  }
  return nb::str(v.c_str());
}

void set_param(Case& c, const std::string& key, nb::handle v) {
  if (nb::isinstance<nb::bool_>(v)) {
    c.set(key, nb::cast<bool>(v));
  } else if (nb::isinstance<nb::int_>(v)) {
    c.set(key, nb::cast<int64_t>(v));
  } else if (nb::isinstance<nb::float_>(v)) {
    c.set(key, nb::cast<double>(v));
  } else if (nb::isinstance<nb::str>(v)) {
    c.set(key, nb::cast<std::string>(v));
  } else {
    throw nb::type_error(("parameter " + key + ": a bool, int, float or str, not " +
                          nb::cast<std::string>(nb::str(v.type())))
                             .c_str());
  }
}

nb::dict params_dict(const Case& c) {
  nb::dict d;
  for (auto& [k, v] : c.p) d[k.c_str()] = param_value(v);
  return d;
}

// ---- tensors <-> NumPy

nb::dlpack::dtype np_dtype(DType dt) {
  switch (dt) {
    case DType::f64:
      return nb::dtype<double>();
    case DType::f32:
      return nb::dtype<float>();
    case DType::bf16:
      return nb::dtype<uint16_t>();  // viewed as ml_dtypes.bfloat16 below
    case DType::f16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::i32:
      return nb::dtype<int32_t>();
    case DType::i64:
      return nb::dtype<int64_t>();
    case DType::u8:
      return nb::dtype<uint8_t>();
    case DType::boolean:
      return nb::dtype<bool>();
  }
  throw std::invalid_argument("unknown dtype");
}

nb::object bf16_type() {
  static nb::object t = nb::module_::import_("ml_dtypes").attr("bfloat16");
  return t;
}

// A NumPy array over `data` (not copied). owner keeps the memory alive (none: the caller's
// buffer, valid only during the call).
nb::object numpy_view(void* data, DType dt, const std::vector<int64_t>& shape, nb::handle owner,
                      bool readonly) {
  std::vector<size_t> shp(shape.begin(), shape.end());
  nb::object a;
  if (readonly) {
    a = nb::ndarray<nb::numpy, nb::ro>(data, shp.size(), shp.data(), owner, nullptr, np_dtype(dt))
            .cast(nb::rv_policy::reference);
  } else {
    a = nb::ndarray<nb::numpy>(data, shp.size(), shp.data(), owner, nullptr, np_dtype(dt))
            .cast(nb::rv_policy::reference);
  }
  if (dt == DType::bf16) a = a.attr("view")(bf16_type());
  return a;
}

// An owning NumPy array holding t (moved, not copied).
nb::object to_numpy(Tensor&& t) {
  auto* heap = new Tensor(std::move(t));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  return numpy_view(heap->bytes(), heap->dtype(), heap->shape(), owner, false);
}

nb::dict to_numpy(TensorMap&& m) {
  nb::dict d;
  for (auto& [k, t] : m) d[k.c_str()] = to_numpy(std::move(t));
  return d;
}

// A Tensor copied from a NumPy array (any dtype moe::DType knows, by its NumPy name).
Tensor from_numpy(nb::handle arr, const std::string& what) {
  nb::module_ np = nb::module_::import_("numpy");
  if (!nb::isinstance(arr, np.attr("ndarray")))
    throw nb::type_error(
        (what + ": expected a numpy.ndarray, got " + nb::cast<std::string>(nb::str(arr.type())))
            .c_str());
  const std::string name = nb::cast<std::string>(arr.attr("dtype").attr("name"));
  DType dt;
  try {
    dt = moe::parse_dtype(name);
  } catch (const std::exception&) {
    throw nb::type_error((what + ": dtype " + name +
                          " is not one of float64, float32, bfloat16, float16, int32, int64, "
                          "uint8, bool")
                             .c_str());
  }
  moe::Shape shape;
  for (nb::handle d : arr.attr("shape")) shape.push_back(nb::cast<int64_t>(d));
  Tensor t(dt, shape);
  nb::bytes b = nb::cast<nb::bytes>(np.attr("ascontiguousarray")(arr).attr("tobytes")());
  if (b.size() != t.nbytes()) throw std::logic_error(what + ": byte count mismatch");
  if (t.nbytes()) std::memcpy(t.bytes(), b.c_str(), t.nbytes());
  return t;
}

TensorMap from_numpy(const nb::dict& d, const std::string& what) {
  TensorMap m;
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    m.emplace(key, from_numpy(v, what + " " + key));
  }
  return m;
}

const moe::ops::OpInfo& op_of(const std::string& name) {
  const moe::ops::OpInfo* op = moe::ops::find_op(name);
  if (!op) {
    std::string names;
    for (const moe::ops::OpInfo* o : moe::ops::all_ops())
      names += (names.empty() ? "" : ", ") + o->name;
    throw nb::value_error(("unknown op '" + name + "' (ops: " + names + ")").c_str());
  }
  return *op;
}

// ---- cases

// The case with fixed parameters applied; nullopt when the result is not a valid case. A key
// the op does not know or a value of the wrong kind is the caller's error (ValueError), on the
// first case already.
std::optional<Case> with_fixed(const Case& c, const std::map<std::string, std::string>& fixed) {
  if (fixed.empty()) return c;
  Case x = c;
  for (auto& [k, v] : fixed) x.p[k] = v;
  moe::ops::validate_case(x);  // throws std::invalid_argument naming the key: a usage error
  try {
    const moe::ops::OpInfo& op = op_of(x.op);
    TensorMap in = op.make_inputs(x);
    (void)op.reference(x, in, false);
  } catch (const std::invalid_argument&) {
    return std::nullopt;
  } catch (const std::out_of_range&) {
    return std::nullopt;
  }
  return x;
}

std::map<std::string, std::string> fixed_strings(const std::string& op, const nb::dict& fixed) {
  std::map<std::string, std::string> out;
  for (auto [k, v] : fixed) {
    Case tmp;
    tmp.op = op;
    const std::string key = nb::cast<std::string>(k);
    set_param(tmp, key, v);
    out[key] = tmp.p.at(key);
  }
  return out;
}

// Named cases then n random ones, drawn exactly as check_impl draws them.
std::vector<Case> make_cases(const std::string& opname, int n, uint64_t seed, bool named,
                             const std::map<std::string, std::string>& fixed) {
  const moe::ops::OpInfo& op = op_of(opname);
  std::vector<Case> out;
  auto take = [&](const Case& c) {
    if (auto x = with_fixed(c, fixed)) out.push_back(*x);
  };
  if (named && op.named)
    for (const Case& c : op.named()) take(c);
  int drawn = 0;
  for (int i = 0; drawn < n && i < 200 * std::max(n, 1); ++i) {
    const int size = 10 + (n > 1 ? drawn * 90 / (n - 1) : 0);
    rc::Shrinkable<Case> s = op.gen()(rc::Random(seed * 1000003ull + i), size);
    auto x = with_fixed(s.value(), fixed);
    if (!x) continue;
    ++drawn;
    out.push_back(*x);
  }
  return out;
}

// ---- Python implementations

std::atomic<int> g_impl_counter{0};

// What a Python implementation's moe::Impl holds: the Python runner (moe_harness/_frameworks.py
// make_runner), released (set to None) when the check is over.
struct PyState {
  nb::object runner;
  nb::object not_supported;  // moe_harness.NotSupported
  std::string name;
};

void run_python(const std::shared_ptr<PyState>& st, const moe::ImplCall& call) {
  nb::gil_scoped_acquire gil;
  try {
    if (!st->runner.is_valid() || st->runner.is_none())
      throw std::runtime_error("the Python implementation " + st->name +
                               " was released (its check is over)");
    nb::dict ins, outs, dtypes;
    for (auto& [k, v] : call.in) {
      const DType dt = moe::ops::dtype_of(v.dtype, k);
      ins[k.c_str()] = numpy_view(v.data, dt, std::vector<int64_t>(v.shape, v.shape + v.ndim),
                                  nb::handle(), true);
      dtypes[k.c_str()] = std::string(moe::dtype_name(dt));
    }
    for (auto& [k, v] : call.out) {
      const DType dt = moe::ops::dtype_of(v.dtype, k);
      outs[k.c_str()] = numpy_view(v.data, dt, std::vector<int64_t>(v.shape, v.shape + v.ndim),
                                   nb::handle(), false);
      dtypes[k.c_str()] = std::string(moe::dtype_name(dt));
    }
    st->runner(nb::cast(Case(call.c), nb::rv_policy::move), call.params_json, ins, outs, dtypes);
  } catch (nb::python_error& e) {
    if (st->not_supported.is_valid() && e.matches(st->not_supported)) {
      throw moe::NotSupported(nb::cast<std::string>(nb::str(e.value())));
    }
    // moe_harness._frameworks wraps the implementation's exception into ImplementationError,
    // whose message is the traceback from the implementation's call down.
    const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
    const std::string value = nb::cast<std::string>(nb::str(e.value()));
    throw std::runtime_error(type == "ImplementationError" ? value : type + ": " + value);
  }
}

moe::TiePolicy ties_of(const std::string& s) {
  try {
    return moe::parse_tie_policy(s);
  } catch (const std::exception& e) {
    throw nb::value_error(e.what());
  }
}

nb::dict case_result(const moe::CaseResult& r) {
  nb::dict d;
  d["case"] = nb::cast(Case(r.c), nb::rv_policy::move);
  d["verdict"] = std::string(moe::verdict_name(r.verdict));
  d["report"] = r.report;
  d["notes"] = r.notes;
  d["original"] = r.original;
  d["worst_pct"] = r.worst_pct;
  d["seconds"] = r.seconds;
  d["named"] = r.named;
  d["invalid_case"] = r.invalid_case;
  return d;
}

std::string register_python_impl(const std::string& op, const std::string& name,
                                 std::shared_ptr<PyState> st, bool deterministic,
                                 const std::vector<std::string>& provides,
                                 const std::string& unwritten = "zeros") {
  op_of(op);
  moe::Impl impl;
  impl.op = op;
  impl.name = name + "-" + std::to_string(++g_impl_counter);
  impl.origin = "python";
  impl.memory = moe::Memory::host;
  impl.deterministic = deterministic;
  impl.provides = provides;
  impl.unwritten = moe::parse_unwritten_rows(unwritten);
  impl.serial = true;
  st->name = impl.name;
  impl.run = [st](const moe::ImplCall& call) { run_python(st, call); };
  impl.keepalive = st;
  const std::string registered = impl.name;
  moe::register_impl(std::move(impl));
  return registered;
}

// A registered Python implementation: release() drops the Python callable (the registry has no
// unregister; the inert entry stays, and a later call of it fails with a clear message).
struct PyImpl {
  std::shared_ptr<PyState> st;
  std::string op, name;
  void release() { st->runner = nb::none(); }
};

PyImpl register_python(const std::string& op, nb::object runner, nb::object not_supported,
                       const std::string& name, bool deterministic,
                       const std::vector<std::string>& provides, const std::string& unwritten) {
  auto st = std::make_shared<PyState>();
  st->runner = runner;
  st->not_supported = not_supported;
  std::string registered;
  try {
    registered = register_python_impl(op, name, st, deterministic, provides, unwritten);
  } catch (const std::invalid_argument& e) {
    throw nb::value_error(e.what());
  }
  return PyImpl{st, op, registered};
}

// check(): every named and random case of op (or the one case_line) through a registered
// Python implementation.
nb::dict check(const PyImpl& pyimpl, int cases, uint64_t seed, const std::string& ties, bool named,
               const nb::dict& fixed_py, std::optional<std::string> case_line, bool shrink,
               int runs, double case_timeout) {
  const std::string& op = pyimpl.op;
  const std::map<std::string, std::string> fixed = fixed_strings(op, fixed_py);
  const std::string impl_name = pyimpl.name;
  const moe::Impl* impl = moe::find_impl(op, impl_name);
  if (!impl) throw nb::value_error(("no implementation " + impl_name + " of " + op).c_str());

  moe::CheckOptions opt;
  opt.cases = cases;
  opt.seed = seed;
  opt.named = named;
  opt.ties = ties_of(ties);
  opt.shrink = shrink;
  opt.runs = runs;
  opt.case_timeout_s = case_timeout;
  opt.jobs = 1;
  if (!fixed.empty()) {
    // Unknown keys and values of the wrong kind are usage errors, reported once, here.
    const moe::ops::OpInfo& info = op_of(op);
    Case probe = info.gen()(rc::Random(seed * 1000003ull), 10).value();
    for (auto& [k, v] : fixed) probe.p[k] = v;
    try {
      moe::ops::validate_case(probe);
    } catch (const std::exception& e) {
      throw nb::value_error(e.what());
    }
    opt.rewrite = [fixed](const Case& c) -> std::optional<Case> {
      try {
        return with_fixed(c, fixed);
      } catch (const std::exception&) {
        return std::nullopt;
      }
    };
  }

  std::vector<moe::CaseResult> rs;
  if (case_line) {
    Case c;
    try {
      c = moe::ops::parse_case_for_op(*case_line);
    } catch (const std::exception& e) {
      throw nb::value_error((std::string("case: ") + e.what()).c_str());
    }
    if (c.op != op)
      throw nb::value_error(("case: the case is of op " + c.op + ", not " + op).c_str());
    nb::gil_scoped_release rel;
    rs.push_back(moe::check_case(*impl, c, opt));
  } else {
    nb::gil_scoped_release rel;
    moe::OpResult o = moe::check_impl(*impl, opt);
    rs = std::move(o.cases);
  }
  nb::list results;
  int passed = 0, failed = 0, ns = 0;
  double worst = 0, seconds = 0;
  for (auto& r : rs) {
    if (r.verdict == moe::Verdict::passed) ++passed;
    if (r.verdict == moe::Verdict::failed) ++failed;
    if (r.verdict == moe::Verdict::not_supported) ++ns;
    worst = std::max(worst, r.worst_pct);
    seconds += r.seconds;
    results.append(case_result(r));
  }
  nb::dict out;
  out["op"] = op;
  out["impl"] = impl_name;
  out["cases"] = results;
  out["passed"] = passed;
  out["failed"] = failed;
  out["not_supported"] = ns;
  out["worst_pct"] = worst;
  out["seconds"] = seconds;
  return out;
}

// compare(): outputs a Python caller computed, checked as check_case checks an implementation
// (an implementation that writes them into the poisoned buffers), against the reference.
nb::dict compare(const Case& c, nb::dict got_py, const std::string& ties) {
  const moe::ops::OpInfo& op = op_of(c.op);
  auto got = std::make_shared<TensorMap>(from_numpy(got_py, "outputs"));
  // Keys must be outputs of this case (named as the reference names them).
  TensorMap want;
  {
    nb::gil_scoped_release rel;
    TensorMap in = op.make_inputs(c);
    want = op.reference(c, in, false);
  }
  std::vector<std::string> provides;
  std::string known;
  for (auto& [k, t] : want) known += (known.empty() ? "" : ", ") + k;
  for (auto& [k, t] : *got) {
    if (!want.count(k))
      throw nb::key_error(
          (k + " is not an output of this case (its outputs: " + known + ")").c_str());
    provides.push_back(k);
  }
  moe::Impl impl;
  impl.op = c.op;
  impl.name = "python-outputs";
  impl.origin = "python";
  impl.provides = provides;
  impl.run = [got](const moe::ImplCall& call) {
    for (auto& [k, v] : call.out) {
      const Tensor& t = got->at(k);
      const DType want_dt = moe::ops::dtype_of(v.dtype, k);
      const moe::Shape want_shape(v.shape, v.shape + v.ndim);
      if (t.dtype() != want_dt || t.shape() != want_shape)
        throw std::runtime_error(k + ": got " + t.describe() + ", the case's output is " +
                                 std::string(moe::dtype_name(want_dt)) +
                                 moe::shape_str(want_shape));
      moe::ops::copy_to_view(t, v, k);
    }
  };
  moe::CheckOptions opt;
  opt.ties = ties_of(ties);
  moe::CaseResult r;
  {
    nb::gil_scoped_release rel;
    r = moe::check_case(impl, c, opt);
  }
  return case_result(r);
}

// ---- golden

nb::dict golden_read(const std::string& path) {
  moe::golden::File f = moe::golden::read_file(path);
  nb::dict out;
  nb::dict meta;
  for (auto& [k, v] : f.metadata) meta[k.c_str()] = v;
  out["metadata"] = meta;
  out["tensors"] = to_numpy(std::move(f.tensors));
  return out;
}

void golden_write(const std::string& path, nb::dict tensors_py, const std::string& op,
                  const std::string& dtype, uint64_t seed, const std::string& params_json,
                  const std::map<std::string, std::string>& extra) {
  TensorMap tensors = from_numpy(tensors_py, "tensor");
  nlohmann::json params;
  try {
    params = nlohmann::json::parse(params_json);
  } catch (const std::exception& e) {
    throw nb::value_error((std::string("params: ") + e.what()).c_str());
  }
  DType dt;
  try {
    dt = moe::parse_dtype(dtype);
  } catch (const std::exception& e) {
    throw nb::value_error(e.what());
  }
  const moe::golden::Metadata meta = moe::golden::make_metadata(op, dt, seed, params, extra);
  // Checked as `golden verify` will check it before anything is written.
  const std::string bytes = moe::golden::serialize(tensors, meta);
  try {
    moe::golden::check_schema(moe::golden::parse(bytes, path), path);
  } catch (const moe::golden::FormatError& e) {
    throw nb::value_error(e.what());
  }
  moe::golden::write_file(path, tensors, meta);
}

nb::dict golden_verify(const std::string& path, const std::string& impl, const std::string& ties) {
  moe::golden::VerifyResult r;
  {
    nb::gil_scoped_release rel;
    r = moe::golden::verify_file(path, impl, ties_of(ties));
  }
  nb::dict d;
  d["path"] = r.path;
  d["op"] = r.op;
  d["dtype"] = r.dtype;
  d["verdict"] = r.verdict;
  d["worst_pct"] = r.worst_pct;
  d["report"] = r.report;
  d["replay"] = r.replay;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "moe-harness bindings (see the moe_harness package)";
  m.attr("version") = MOE_VERSION;
  m.attr("git_revision") = MOE_GIT_REV;

  nb::class_<Case>(m, "Case")
      .def(nb::init<>())
      .def_static(
          "parse",
          [](const std::string& line) {
            try {
              return moe::ops::parse_case_for_op(line);
            } catch (const std::exception& e) {
              throw nb::value_error(e.what());
            }
          },
          "line"_a)
      .def_prop_ro("op", [](const Case& c) { return c.op; })
      .def_prop_ro("dtype", [](const Case& c) { return std::string(moe::dtype_name(c.dtype)); })
      .def_prop_ro("regime", [](const Case& c) { return std::string(moe::regime_name(c.regime)); })
      .def_prop_ro("seed", [](const Case& c) { return c.seed; })
      .def_prop_ro("line", &Case::line)
      .def_prop_ro("params", &params_dict)
      .def_prop_ro("spec_params_json",
                   [](const Case& c) {
                     const moe::ops::OpInfo& op = op_of(c.op);
                     return op.to_params ? moe::golden::format_params(op.to_params(c))
                                         : std::string("{}");
                   })
      .def("with_params",
           [](const Case& c, const nb::dict& d) {
             Case x = c;
             for (auto [k, v] : d) set_param(x, nb::cast<std::string>(k), v);
             try {
               moe::ops::validate_case(x);
             } catch (const std::exception& e) {
               throw nb::value_error(e.what());
             }
             return x;
           })
      .def("make_inputs",
           [](const Case& c) {
             TensorMap in;
             {
               nb::gil_scoped_release rel;
               in = op_of(c.op).make_inputs(c);
             }
             return to_numpy(std::move(in));
           })
      .def("reference",
           [](const Case& c) {
             TensorMap out;
             {
               nb::gil_scoped_release rel;
               const moe::ops::OpInfo& op = op_of(c.op);
               out = op.reference(c, op.make_inputs(c), false);
             }
             return to_numpy(std::move(out));
           })
      .def("__eq__", [](const Case& a, const Case& b) { return a == b; })
      .def("__hash__", [](const Case& c) { return std::hash<std::string>()(c.line()); });

  m.def("ops", [] {
    std::vector<std::string> v;
    for (const moe::ops::OpInfo* o : moe::ops::all_ops()) v.push_back(o->name);
    return v;
  });
  m.def("op_info", [](const std::string& name) {
    const moe::ops::OpInfo& op = op_of(name);
    nb::dict d;
    d["name"] = op.name;
    d["spec"] = op.spec;
    d["has_cuda_twin"] = static_cast<bool>(op.gpu);
    return d;
  });
  m.def(
      "impls",
      [](const std::string& op) {
        std::vector<std::vector<std::string>> v;
        for (const moe::Impl* p : moe::impls(op)) v.push_back({p->op, p->name, p->origin});
        return v;
      },
      "op"_a = "");
  m.def(
      "cases",
      [](const std::string& op, int n, uint64_t seed, bool named, const nb::dict& fixed) {
        const auto f = fixed_strings(op, fixed);
        try {
          return make_cases(op, n, seed, named, f);
        } catch (const std::invalid_argument& e) {
          throw nb::value_error(e.what());
        }
      },
      "op"_a, "n"_a, "seed"_a, "named"_a, "fixed"_a);
  nb::class_<PyImpl>(m, "PythonImpl")
      .def_prop_ro("op", [](const PyImpl& p) { return p.op; })
      .def_prop_ro("name", [](const PyImpl& p) { return p.name; })
      .def("release", &PyImpl::release);
  m.def("register_python", &register_python, "op"_a, "runner"_a, "not_supported"_a, "name"_a,
        "deterministic"_a, "provides"_a, "unwritten"_a = "zeros");
  m.def("check", &check, "impl"_a, "cases"_a, "seed"_a, "ties"_a, "named"_a, "fixed"_a,
        "case_line"_a.none(), "shrink"_a, "runs"_a = 2, "case_timeout"_a = 0.0);
  m.def("compare", &compare, "case"_a, "outputs"_a, "ties"_a);
  // Where check's crash and case-timeout messages go (harness/ops/call_guard.h): the pytest
  // plugin passes a copy of the terminal's stderr.
  m.def("_set_message_fd", &moe::ops::set_message_fd, "fd"_a);
  m.def("golden_read", &golden_read, "path"_a);
  m.def("golden_write", &golden_write, "path"_a, "tensors"_a, "op"_a, "dtype"_a, "seed"_a,
        "params_json"_a, "extra"_a);
  m.def("golden_verify", &golden_verify, "path"_a, "impl"_a, "ties"_a);
  m.def("golden_file_name", [](const Case& c) { return moe::golden::file_name(c); });
  m.def("golden_schema", [](const std::string& op) {
    const moe::golden::OpSchema* s = moe::golden::find_schema(op);
    if (!s) throw nb::value_error(("op '" + op + "' is not in the SPEC §14 table").c_str());
    auto names = [](const std::vector<moe::golden::TensorSpec>& v) {
      std::vector<std::pair<std::string, bool>> o;
      for (auto& t : v) o.emplace_back(t.name, t.optional);
      return o;
    };
    nb::dict d;
    d["inputs"] = names(s->inputs);
    d["outputs"] = names(s->outputs);
    d["cotangents"] = names(s->cotangents);
    d["grads"] = names(s->grads);
    d["params"] = s->params;
    return d;
  });
  m.def("format_params", [](const std::string& json_text) {
    return moe::golden::format_params(nlohmann::json::parse(json_text));
  });

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const moe::golden::FormatError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

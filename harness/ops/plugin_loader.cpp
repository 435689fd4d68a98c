// load_plugin (include/moe_harness/impl.h): dlopen a shared library that speaks the C plugin ABI
// (include/moe_harness/plugin.h), check its ABI version before reading anything else, validate
// its descriptor, and register one Impl per op. A plugin is untrusted input: every field is
// checked and every fault is an std::invalid_argument naming the path and the field.
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include "harness/ops/registry.h"
#include "moe_harness/impl.h"
#include "moe_harness/plugin.h"

namespace moe {

namespace {

std::string bounded(const char* s, size_t max, const std::string& what, const std::string& path) {
  if (!s) throw std::invalid_argument("plugin " + path + ": " + what + " is NULL");
  const size_t n = strnlen(s, max + 1);
  if (n > max)
    throw std::invalid_argument("plugin " + path + ": " + what + " is longer than " +
                                std::to_string(max) + " characters");
  return std::string(s, n);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b != std::string::npos) v.push_back(item.substr(b, e - b + 1));
  }
  return v;
}

}  // namespace

std::string load_plugin(const std::string& path) {
  // RTLD_LAZY: a plugin wrapping a library with symbols it never calls still loads (TE's
  // library references a cuBLASLt symbol newer than some installs have).
  void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (!handle) {
    const char* err = dlerror();
    throw std::invalid_argument("--plugin " + path + ": cannot load: " + (err ? err : "?"));
  }
  std::shared_ptr<void> lib(handle, [](void* h) { dlclose(h); });
  auto version_fn =
      reinterpret_cast<moe_plugin_abi_version_fn>(dlsym(handle, "moe_plugin_abi_version"));
  if (!version_fn)
    throw std::invalid_argument("--plugin " + path +
                                ": not a moe-harness plugin (no symbol moe_plugin_abi_version)");
  const uint32_t version = version_fn();
  if (version != MOE_PLUGIN_ABI_VERSION)
    throw std::invalid_argument("--plugin " + path + ": built for plugin ABI version " +
                                std::to_string(version) + ", this moe-harness speaks version " +
                                std::to_string(MOE_PLUGIN_ABI_VERSION) +
                                "; rebuild it against this harness's moe_harness/plugin.h");
  auto describe_fn = reinterpret_cast<moe_plugin_describe_fn>(dlsym(handle, "moe_plugin_describe"));
  if (!describe_fn)
    throw std::invalid_argument("--plugin " + path + ": no symbol moe_plugin_describe");
  const moe_plugin* p = describe_fn();
  if (!p) throw std::invalid_argument("--plugin " + path + ": moe_plugin_describe returned NULL");
  const std::string name = bounded(p->name, 64, "moe_plugin.name", path);
  if (name.empty() || name.find_first_of(" \t\n'\"") != std::string::npos)
    throw std::invalid_argument("--plugin " + path + ": implementation name '" + name +
                                "' is empty or has a space or quote");
  if (p->num_ops < 0 || p->num_ops > 1024 || (p->num_ops > 0 && !p->ops))
    throw std::invalid_argument("--plugin " + path + ": moe_plugin.num_ops " +
                                std::to_string(p->num_ops) + " with ops " +
                                (p->ops ? "set" : "NULL"));
  const std::string origin = "plugin " + path;
  std::set<std::string> seen;
  std::vector<Impl> to_register;
  for (int32_t i = 0; i < p->num_ops; ++i) {
    const moe_plugin_op& d = p->ops[i];
    const std::string where = "ops[" + std::to_string(i) + "]";
    const std::string op = bounded(d.op, 128, where + ".op", path);
    const ops::OpInfo* info = ops::find_op(op);
    if (!info)
      throw std::invalid_argument("--plugin " + path + ": " + where + ".op: unknown op '" + op +
                                  "' (see `moe-harness list`)");
    if (!seen.insert(op).second)
      throw std::invalid_argument("--plugin " + path + ": op " + op + " is described twice");
    if (d.device_type != kDLCPU && d.device_type != kDLCUDA)
      throw std::invalid_argument("--plugin " + path + ": " + where + ".device_type " +
                                  std::to_string(d.device_type) +
                                  " (allowed: kDLCPU = 1, kDLCUDA = 2)");
    if (!d.run) throw std::invalid_argument("--plugin " + path + ": " + where + ".run is NULL");
    Impl impl;
    impl.op = op;
    impl.name = name;
    impl.origin = origin;
    impl.memory = d.device_type == kDLCUDA ? Memory::cuda : Memory::host;
    impl.deterministic = d.deterministic != 0;
    if (d.provides) {
      impl.provides = split_commas(bounded(d.provides, 4096, where + ".provides", path));
      for (auto& k : impl.provides)
        if (k.rfind("output.", 0) != 0 && k.rfind("grad.", 0) != 0)
          throw std::invalid_argument("--plugin " + path + ": " + where + ".provides: '" + k +
                                      "' is not an output.* or grad.* name");
    }
    auto run = d.run;
    impl.keepalive = lib;
    impl.run = [run, op, path](const ImplCall& call) {
      // Names and tensors as C arrays that live for the call.
      std::vector<moe_named_tensor> ins, outs;
      for (auto& [k, v] : call.in) ins.push_back({k.c_str(), v});
      for (auto& [k, v] : call.out) outs.push_back({k.c_str(), v});
      const std::string line = call.c.line();
      const std::string dtype(dtype_name(call.c.dtype));
      std::vector<char> msg(4096, '\0');
      moe_call mc{};
      mc.abi_version = MOE_PLUGIN_ABI_VERSION;
      mc.op = op.c_str();
      mc.case_line = line.c_str();
      mc.params_json = call.params_json.c_str();
      mc.dtype = dtype.c_str();
      mc.num_inputs = static_cast<int64_t>(ins.size());
      mc.inputs = ins.data();
      mc.num_outputs = static_cast<int64_t>(outs.size());
      mc.outputs = outs.data();
      mc.stream = call.stream;
      mc.message = msg.data();
      mc.message_size = msg.size();
      const int32_t status = run(&mc);
      msg.back() = '\0';  // the plugin may have filled the whole buffer
      const std::string text(msg.data());
      if (status == MOE_STATUS_OK) return;
      if (status == MOE_STATUS_NOT_SUPPORTED)
        throw NotSupported(text.empty() ? "not supported by the plugin" : text);
      throw std::runtime_error("plugin " + path + " returned status " + std::to_string(status) +
                               (text.empty() ? "" : ": " + text));
    };
    to_register.push_back(std::move(impl));
  }
  for (auto& impl : to_register) register_impl(std::move(impl));
  return name;
}

}  // namespace moe

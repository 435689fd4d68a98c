// Registry-driven GPU checks, generated for every op that has a CUDA twin: random cases from the
// op's generator and every named case pass check_gpu (CUDA vs reference within SPEC §12, the
// tie-aware comparison for the router family, and two GPU runs bitwise equal). Skips, with the
// reason, where there is no GPU.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include "harness/ops/check.h"
#include "harness/ops/registry.h"

using namespace moe;
using namespace moe::ops;

namespace {

std::vector<std::string> gpu_op_names() {
  std::vector<std::string> v;
  for (const OpInfo* op : all_ops())
    if (op->gpu) v.push_back(op->name);
  if (v.empty()) v.push_back("none");  // keeps the suite instantiated in CPU-only builds
  return v;
}

class RegistryGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
    if (!find_op(GetParam())) GTEST_SKIP() << "no op has a CUDA twin in this build";
  }
  const OpInfo& op() const { return *find_op(GetParam()); }
};

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "gpu");
}

TEST_P(RegistryGpu, RandomCasesMatchReference) {
  const OpInfo& o = op();
  const bool ok = rc::check(o.name + ": CUDA vs reference", [&o] {
    const Case c = *o.gen();
    RC_TAG(std::string(regime_name(c.regime)));
    const Report r = check_gpu(o, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  });
  EXPECT_TRUE(ok);
}

TEST_P(RegistryGpu, NamedCasesMatchReference) {
  const OpInfo& o = op();
  for (const Case& c : o.named()) {
    const Report r = check_gpu(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

INSTANTIATE_TEST_SUITE_P(AllGpuOps, RegistryGpu, ::testing::ValuesIn(gpu_op_names()),
                         [](const auto& info) { return info.param; });

}  // namespace

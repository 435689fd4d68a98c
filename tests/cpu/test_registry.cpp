// Registry-driven reference checks, generated for every registered op (no per-op bodies):
//   - RandomCases: cases from the op's generator pass check_reference (the SPEC §12 invariants and
//     every gradient against finite differences of the fp64 reference).
//   - NamedCases: every named case (regression cases, golden catalogue) passes the same checks.
//   - Schema: outputs carry only SPEC §14 tensor names, and to_params/from_params round-trip.
// rapidcheck's seed and case count come from RC_PARAMS (pinned by ctest; printed on failure).
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include "harness/ops/check.h"
#include "harness/ops/registry.h"

using namespace moe;
using namespace moe::ops;

namespace {

std::vector<std::string> op_names() {
  std::vector<std::string> v;
  for (const OpInfo* op : all_ops()) v.push_back(op->name);
  return v;
}

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "reference");
}

class Registry : public ::testing::TestWithParam<std::string> {
 protected:
  const OpInfo& op() const { return *find_op(GetParam()); }
};

TEST_P(Registry, RandomCasesPassReferenceChecks) {
  const OpInfo& o = op();
  const bool ok = rc::check(o.name + ": reference self-check", [&o] {
    const Case c = *o.gen();
    RC_TAG(std::string(regime_name(c.regime)));
    RC_CLASSIFY(c.dtype == DType::bf16, "bf16");
    const Report r = check_reference(o, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  });
  EXPECT_TRUE(ok);
}

TEST_P(Registry, NamedCasesPassReferenceChecks) {
  const OpInfo& o = op();
  ASSERT_TRUE(o.named) << o.name << " has no named cases";
  const auto cases = o.named();
  EXPECT_FALSE(cases.empty());
  for (const Case& c : cases) {
    const Report r = check_reference(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

TEST_P(Registry, TensorNamesAndParamsFollowTheGoldenSchema) {
  const OpInfo& o = op();
  for (const Case& c : o.named()) {
    const TensorMap in = o.make_inputs(c);
    const TensorMap out = o.reference(c, in, false);
    for (auto& [k, v] : in) {
      EXPECT_TRUE(k.rfind("input.", 0) == 0 || k.rfind("cotangent.", 0) == 0) << k;
      if (k.rfind("cotangent.", 0) == 0) {
        EXPECT_TRUE(out.count("output." + k.substr(10))) << k << " has no output in " << c.line();
      }
    }
    for (auto& [k, v] : out) {
      EXPECT_TRUE(k.rfind("output.", 0) == 0 || k.rfind("grad.", 0) == 0) << k;
      if (k.rfind("grad.", 0) == 0) {
        EXPECT_TRUE(in.count("input." + k.substr(5))) << k << " has no input in " << c.line();
      }
    }
    ASSERT_TRUE(o.to_params && o.from_params) << o.name;
    const nlohmann::json params = o.to_params(c);
    const Case back = o.from_params(params, c.dtype, c.seed, in);
    EXPECT_EQ(o.to_params(back), params) << c.line();
    // The rebuilt case regenerates the same inputs and outputs.
    const TensorMap out2 = o.reference(back, in, false);
    for (auto& [k, v] : out) {
      ASSERT_TRUE(out2.count(k)) << k;
      EXPECT_TRUE(out2.at(k).bitwise_equal(v)) << k << " after from_params: " << back.line();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, Registry, ::testing::ValuesIn(op_names()),
                         [](const auto& info) { return info.param; });

}  // namespace

// moe_multi_gpu_tests: the NCCL suite, one process per GPU under the launcher:
//
//   moe-harness launch -n 2 -- moe_multi_gpu_tests [gtest flags]
//   moe-harness launch -n 2 -- moe_multi_gpu_tests --bench [--max-tokens N] [--hidden H]
//                                                         [--topk K] [--iters N] [--json FILE]
//
// Without the launcher's environment every test skips with the reason. A rank whose communicator
// was aborted by an NCCL or CUDA error exits after that test (status 1), so the launcher ends the
// other ranks instead of leaving them waiting in a collective.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "tests/multi_gpu/nccl_env.h"
#include "tools/bench_a2a.h"

namespace moe::testing {

namespace {

std::unique_ptr<gpu::NcclCommunicator> g_comm;

int local_world_size() {
  const char* v = std::getenv("MOE_LOCAL_WORLD_SIZE");
  if (!v || !*v) v = std::getenv("MOE_WORLD_SIZE");
  return v ? std::atoi(v) : 0;
}

class AbortListener : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (g_comm && g_comm->aborted()) {
      std::fprintf(stderr,
                   "moe_multi_gpu_tests: rank %d: the NCCL communicator was aborted in %s.%s; "
                   "exiting so the launcher ends every rank\n",
                   g_comm->rank(), t.test_suite_name(), t.name());
      std::fflush(stdout);
      std::_Exit(1);
    }
  }
};

}  // namespace

gpu::NcclCommunicator* nccl_comm(std::string* why_not) {
  if (g_comm) return g_comm.get();
  if (!gpu::NcclBootstrap::launched()) {
    *why_not =
        "MOE_WORLD_SIZE is unset: run under the launcher, e.g. `moe-harness launch -n 2 -- "
        "moe_multi_gpu_tests`";
    return nullptr;
  }
  const int gpus = gpu::device_count(), local = local_world_size();
  if (gpus < local) {
    *why_not = std::to_string(local) + " local ranks but " + std::to_string(gpus) +
               " CUDA device(s) visible";
    return nullptr;
  }
  try {
    g_comm = std::make_unique<gpu::NcclCommunicator>(gpu::NcclBootstrap::from_env());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_multi_gpu_tests: cannot create the NCCL communicator: %s\n",
                 e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
  return g_comm.get();
}

}  // namespace moe::testing

namespace {

int run_bench(int argc, char** argv) {
  CLI::App app{"moe_multi_gpu_tests --bench: the ragged all-to-all benchmark over NCCL"};
  moe::tools::RaggedA2ABenchOptions o;
  bool bench = false;
  app.add_flag("--bench", bench, "Run the benchmark instead of the tests");
  app.add_option("--hidden", o.hidden, "bf16 columns per row");
  app.add_option("--topk", o.topk, "Rows per token");
  app.add_option("--min-tokens", o.min_tokens, "Smallest tokens per rank");
  app.add_option("--max-tokens", o.max_tokens, "Largest tokens per rank (sizes double)");
  app.add_option("--warmup", o.warmup, "Untimed calls per row");
  app.add_option("--iters", o.iters, "Timed calls per row");
  app.add_option("--seed", o.seed, "Seed of the pattern data");
  app.add_option("--json", o.json, "Rank 0 writes the rows here");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    return moe::tools::run_ragged_a2a_bench(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench failed: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered even into the launcher's pipe, so a rank's last lines survive a teardown.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bench") == 0) return run_bench(argc, argv);
  }
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::UnitTest::GetInstance()->listeners().Append(new moe::testing::AbortListener);
  const int rc = RUN_ALL_TESTS();
  moe::testing::g_comm.reset();  // ncclCommDestroy before the CUDA runtime shuts down
  return rc;
}

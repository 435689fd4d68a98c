// Registers a host implementation of sort_chunks_by_index (SPEC §7) and checks it against the
// moe-harness reference: every named case plus 30 random ones. Exit 0 when all pass, 1 when a
// case fails, 2 on an error. `--bug` plants an off-by-one (the first padding row is skipped), so
// the checks must fail.
#include <moe_harness/impl.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

namespace {

bool g_bug = false;

// dst(i) of SPEC §7: chunk c's rows go, in order, after the chunks sorted_indices puts before it;
// rows past V = sum(split_sizes) stay where they are.
std::vector<int64_t> chunk_sort_map(const moe::Tensor& split, const moe::Tensor& order, int64_t n) {
  const int64_t C = split.numel();
  std::vector<int64_t> start(C), out_start(C);
  int64_t V = 0;
  for (int64_t c = 0; c < C; ++c) start[c] = V, V += static_cast<int64_t>(split.at(c));
  int64_t acc = 0;
  for (int64_t j = 0; j < C; ++j) {
    const auto c = static_cast<int64_t>(order.at(j));
    out_start[c] = acc;
    acc += static_cast<int64_t>(split.at(c));
  }
  std::vector<int64_t> dst(n);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t o = 0; o < static_cast<int64_t>(split.at(c)); ++o)
      dst[start[c] + o] = out_start[c] + o;
  for (int64_t i = g_bug ? V + 1 : V; i < n; ++i) dst[i] = i;  // --bug: off by one
  return dst;
}

// Row r of src to row w of dst, bitwise (pure data movement, any dtype).
void copy_row(moe::Tensor& dst, int64_t w, const moe::Tensor& src, int64_t r) {
  const size_t row = static_cast<size_t>(src.row_stride()) * moe::dtype_size(src.dtype());
  std::memcpy(dst.bytes() + w * row, src.bytes() + r * row, row);
}

void sort_chunks(const moe::Case&, const moe::TensorMap& in, moe::TensorMap& out) {
  const moe::Tensor& x = in.at("input.x");
  const int64_t n = x.dim(0);
  const auto dst = chunk_sort_map(in.at("input.split_sizes"), in.at("input.sorted_indices"), n);
  const moe::Tensor* probs = in.count("input.probs") ? &in.at("input.probs") : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    out.at("output.row_id_map").set(i, static_cast<double>(dst[i]));
    copy_row(out.at("output.sorted"), dst[i], x, i);  // forward: a scatter
    if (probs) copy_row(out.at("output.sorted_probs"), dst[i], *probs, i);
    // backward: the gather with the same map
    if (out.count("grad.x")) copy_row(out.at("grad.x"), i, in.at("cotangent.sorted"), dst[i]);
    if (probs && out.count("grad.probs"))
      copy_row(out.at("grad.probs"), i, in.at("cotangent.sorted_probs"), dst[i]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  g_bug = argc > 1 && std::strcmp(argv[1], "--bug") == 0;
  try {
    moe::register_impl(moe::host_impl("sort_chunks_by_index", "consumer", sort_chunks));
    moe::CheckOptions opt;
    opt.cases = 30;
    const moe::OpResult r =
        moe::check_impl(*moe::find_impl("sort_chunks_by_index", "consumer"), opt);
    std::printf("%-22s %-10s %5s %6s %6s %13s %9s %s\n", "op", "impl", "cases", "passed", "failed",
                "not_supported", "worst_%", "disposition");
    std::printf("%-22s %-10s %5zu %6d %6d %13d %9.1f %s\n", r.op.c_str(), r.impl.c_str(),
                r.cases.size(), r.passed, r.failed, r.not_supported, r.worst_pct,
                r.disposition().c_str());
    for (const moe::CaseResult& c : r.cases) {
      if (c.verdict != moe::Verdict::failed) continue;
      std::printf("first failure:\n%s\nreplay: %s\n", c.report.c_str(), c.replay.c_str());
      break;
    }
    return r.failed > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_consumer: %s\n", e.what());
    return 2;
  }
}

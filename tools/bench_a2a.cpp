// Ragged all-to-all benchmark over NCCL (tools/bench_a2a.h). Per size (tokens per rank, rows =
// tokens * topk bf16 rows of `hidden` columns), four rows in the same run:
//   ncclAlltoAll       the equal-count collective, count = rows/P rows per peer (the baseline)
//   send/recv equal    the same exchange as one ncclSend/ncclRecv group
//   ragged uniform     NcclCommunicator::ragged_all_to_all with the same per-peer counts
//   ragged skewed      half of every rank's rows to rank 0, the rest evenly over all ranks
// Every row is first run once on pattern data (gpu::a2a_pattern_fill) and each rank counts the
// wrong words of its receive buffer, unwritten rows included; #wrong is the sum over ranks.
// Then `warmup` untimed calls and `iters` timed ones (CUDA events, a barrier before each); time
// is the median per rank, then the maximum over ranks. Columns follow nccl-tests' alltoall:
// size = bytes each rank sends, algbw = size / time, busbw = algbw * (P-1)/P. The last column is
// busbw over ncclAlltoAll's at the same size.
#include "tools/bench_a2a.h"

#include <cstdio>

#ifdef MOE_WITH_NCCL
#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "gpu/nccl_comm.cuh"
#include "gpu/runtime.cuh"
#endif

namespace moe::tools {

#ifdef MOE_WITH_NCCL

namespace {

using Matrix = std::vector<std::vector<int64_t>>;  // [s][d] rows rank s sends to rank d

Matrix traffic(const std::string& pattern, int P, int64_t rows) {
  Matrix m(P, std::vector<int64_t>(P, 0));
  for (int s = 0; s < P; ++s) {
    if (pattern == "uniform") {
      for (int d = 0; d < P; ++d) m[s][d] = rows / P;
    } else {  // skewed
      const int64_t hot = rows / 2, rest = rows - hot;
      for (int d = 0; d < P; ++d) m[s][d] = rest / P + (d < rest % P ? 1 : 0);
      m[s][0] += hot;
    }
  }
  return m;
}

// Rank me's four §9.2 arrays (forward layout: source-major receive buffers).
struct Arrays {
  gpu::DeviceTensor in_off, send, out_off, recv;
};
Arrays upload_arrays(const Matrix& m, int me, gpu::Stream s) {
  const int P = static_cast<int>(m.size());
  Tensor in_off(DType::i32, {P}), send(DType::i32, {P}), out_off(DType::i32, {P}),
      recv(DType::i32, {P});
  int64_t acc = 0;
  for (int j = 0; j < P; ++j) {
    send.set(j, static_cast<double>(m[me][j]));
    in_off.set(j, static_cast<double>(acc));
    acc += m[me][j];
    recv.set(j, static_cast<double>(m[j][me]));
    int64_t off = 0;
    for (int i = 0; i < me; ++i) off += m[i][j];
    out_off.set(j, static_cast<double>(off));
  }
  return {gpu::DeviceTensor::upload(in_off, s), gpu::DeviceTensor::upload(send, s),
          gpu::DeviceTensor::upload(out_off, s), gpu::DeviceTensor::upload(recv, s)};
}

// Where each source's chunk lands in rank me's receive buffer.
std::vector<gpu::A2AChunk> chunks_into(const Matrix& m, int me) {
  const int P = static_cast<int>(m.size());
  std::vector<gpu::A2AChunk> c;
  int64_t dst = 0;
  for (int s = 0; s < P; ++s) {
    int64_t src_row = 0;
    for (int j = 0; j < me; ++j) src_row += m[s][j];
    c.push_back({s, src_row, dst, m[s][me]});
    dst += m[s][me];
  }
  return c;
}

int64_t recv_rows_of(const Matrix& m) {
  int64_t most = 0;
  for (size_t d = 0; d < m.size(); ++d) {
    int64_t total = 0;
    for (size_t s = 0; s < m.size(); ++s) total += m[s][d];
    most = std::max(most, total);
  }
  return most;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

struct Row {
  int64_t size = 0, tokens = 0, rows = 0;
  std::string pattern, op;
  double time_us = 0, algbw = 0, busbw = 0, vs_alltoall = 0;
  int64_t wrong = 0;
};

}  // namespace

int run_ragged_a2a_bench(const RaggedA2ABenchOptions& o) {
  if (!gpu::NcclBootstrap::launched()) {
    std::fprintf(stderr,
                 "bench ragged_all_to_all: needs one process per GPU; run it under the launcher: "
                 "moe-harness launch -n <GPUs> -- <this command>\n");
    return 2;
  }
  if (o.hidden <= 0 || o.topk <= 0 || o.min_tokens <= 0 || o.max_tokens < o.min_tokens ||
      o.iters <= 0 || o.warmup < 0) {
    std::fprintf(stderr,
                 "bench ragged_all_to_all: need hidden, topk, min_tokens > 0, max_tokens >= "
                 "min_tokens, iters > 0, warmup >= 0\n");
    return 2;
  }
  gpu::NcclCommunicator comm(gpu::NcclBootstrap::from_env());
  const int P = comm.size(), me = comm.rank();
  const bool lead = me == 0;
  const gpu::Stream s = comm.stream();
  const int64_t H = o.hidden, row_bytes = 2 * H, max_rows = o.max_tokens * o.topk;
  gpu::DeviceTensor send(DType::bf16, {max_rows, H});
  gpu::DeviceTensor recv(DType::bf16, {static_cast<int64_t>(P) * max_rows, H});
  gpu::ErrorFlag flag;

  if (lead) {
    std::printf("# ragged_all_to_all over NCCL %s: %d ranks, one per GPU (%s)\n",
                gpu::NcclCommunicator::library_version().c_str(), P,
                gpu::device_description().c_str());
    std::printf(
        "# bf16 rows of hidden %lld, top-%lld; warmup %d, iters %d (median, max over "
        "ranks); busbw = algbw*(P-1)/P\n",
        static_cast<long long>(H), static_cast<long long>(o.topk), o.warmup, o.iters);
    std::printf("# %12s %7s %8s %-8s %-18s %10s %11s %11s %7s %9s\n", "size(B)", "tokens", "rows",
                "traffic", "op", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "busbw/a2a");
  }
  std::vector<Row> rows_out;
  int64_t total_wrong = 0;

  // One row: verify on pattern data, then time. rows_sent: rows this rank sends.
  auto measure = [&](Row row, const Matrix& m, const std::function<void()>& op) {
    const int64_t rows_sent = [&] {
      int64_t n = 0;
      for (int64_t v : m[me]) n += v;
      return n;
    }();
    const int64_t recv_rows = recv_rows_of(m);
    gpu::a2a_pattern_fill(send.data(), rows_sent, row_bytes, o.seed, me, s);
    gpu::a2a_pattern_fill(recv.data(), recv_rows, row_bytes, o.seed, P + me, s);
    flag.reset(s);
    op();
    const gpu::DeviceError e = flag.read(s);
    if (e.code != 0) gpu::throw_if_a2a_fault(e, rows_sent, recv_rows);
    const int64_t wrong = gpu::a2a_pattern_count_wrong(recv.data(), recv_rows, row_bytes, o.seed,
                                                       me, P, chunks_into(m, me), s);
    row.wrong = comm.all_reduce_sum(wrong);
    for (int i = 0; i < o.warmup; ++i) op();
    const double t = comm.all_reduce_max(median(gpu::time_calls(comm, s, o.iters, op)));
    row.time_us = t;
    row.algbw = static_cast<double>(row.size) / (t * 1e-6) / 1e9;
    row.busbw = row.algbw * (P - 1) / P;
    return row;
  };

  for (int64_t tokens = o.min_tokens; tokens <= o.max_tokens; tokens *= 2) {
    const int64_t rows = tokens * o.topk, per_peer = rows / P;
    Row base;
    base.tokens = tokens;
    base.rows = rows;
    base.size = per_peer * P * row_bytes;
    const Matrix uniform = traffic("uniform", P, rows), skewed = traffic("skewed", P, rows);
    const Arrays ua = upload_arrays(uniform, me, s), sa = upload_arrays(skewed, me, s);
    auto ragged = [&](const Matrix& m, const Arrays& a) {
      const gpu::RaggedA2ARank rank{me,
                                    send.data(),
                                    max_rows,
                                    recv.data(),
                                    recv_rows_of(m),
                                    a.in_off.data<int32_t>(),
                                    a.send.data<int32_t>(),
                                    a.out_off.data<int32_t>(),
                                    a.recv.data<int32_t>()};
      return [&comm, &flag, rank, row_bytes, s] {
        comm.ragged_all_to_all({rank}, row_bytes, flag.device_ptr(), s);
      };
    };
    std::vector<Row> group;
    Row r = base;
    r.pattern = "uniform";
    if (gpu::NcclCommunicator::has_alltoall()) {
      r.op = "ncclAlltoAll";
      group.push_back(measure(r, uniform, [&] {
        comm.all_to_all_equal(send.data(), recv.data(), per_peer * row_bytes, s);
      }));
    }
    r.op = "send/recv equal";
    group.push_back(measure(r, uniform, [&] {
      comm.all_to_all_equal(send.data(), recv.data(), per_peer * row_bytes, s, true);
    }));
    r.op = "ragged_all_to_all";
    group.push_back(measure(r, uniform, ragged(uniform, ua)));
    r.pattern = "skewed";
    group.push_back(measure(r, skewed, ragged(skewed, sa)));
    const double ref_busbw = group.front().busbw;
    for (Row& g : group) {
      g.vs_alltoall = ref_busbw > 0 ? g.busbw / ref_busbw : 0;
      total_wrong += g.wrong;
      if (lead) {
        std::printf("  %12lld %7lld %8lld %-8s %-18s %10.1f %11.2f %11.2f %7lld %9.3f\n",
                    static_cast<long long>(g.size), static_cast<long long>(g.tokens),
                    static_cast<long long>(g.rows), g.pattern.c_str(), g.op.c_str(), g.time_us,
                    g.algbw, g.busbw, static_cast<long long>(g.wrong), g.vs_alltoall);
        std::fflush(stdout);
      }
      rows_out.push_back(g);
    }
  }
  if (lead) {
    for (const Row& g : rows_out) {
      if (g.tokens == o.max_tokens && g.op == "ragged_all_to_all" && g.pattern == "uniform") {
        std::printf(
            "# ragged uniform at %lld tokens: busbw %.2f GB/s = %.1f%% of %s (target >= "
            "85%%: %s)\n",
            static_cast<long long>(g.tokens), g.busbw, 100 * g.vs_alltoall,
            gpu::NcclCommunicator::has_alltoall() ? "ncclAlltoAll" : "send/recv equal",
            g.vs_alltoall >= 0.85 ? "met" : "NOT met");
      }
    }
    std::printf("# #wrong total: %lld\n", static_cast<long long>(total_wrong));
    if (!o.json.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& g : rows_out) {
        j.push_back({{"size", g.size},
                     {"tokens", g.tokens},
                     {"rows", g.rows},
                     {"traffic", g.pattern},
                     {"op", g.op},
                     {"time_us", g.time_us},
                     {"algbw_gbs", g.algbw},
                     {"busbw_gbs", g.busbw},
                     {"wrong", g.wrong},
                     {"busbw_vs_alltoall", g.vs_alltoall}});
      }
      std::ofstream(o.json) << j.dump(1) << "\n";
    }
  }
  return total_wrong == 0 ? 0 : 1;
}

#else

int run_ragged_a2a_bench(const RaggedA2ABenchOptions&) {
  std::fprintf(stderr,
               "bench ragged_all_to_all: this build has no NCCL (nccl.h and libnccl "
               "were not found at configure time)\n");
  return 2;
}

#endif

}  // namespace moe::tools

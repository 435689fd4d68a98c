#include "harness/core/params/ep.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace moe {

namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

std::string str(int64_t v) {
  return std::to_string(v);
}

void check_num_ep(int64_t num_ep) {
  if (num_ep < 1) bad("num_ep: must be >= 1, got " + str(num_ep));
}

}  // namespace

std::string_view a2a_direction_name(A2ADirection d) {
  return d == A2ADirection::forward ? "forward" : "reverse";
}

A2ADirection parse_a2a_direction(std::string_view s) {
  if (s == "forward") return A2ADirection::forward;
  if (s == "reverse") return A2ADirection::reverse;
  bad("direction: unknown value '" + std::string(s) + "' (expected forward or reverse)");
}

A2ADirection opposite(A2ADirection d) {
  return d == A2ADirection::forward ? A2ADirection::reverse : A2ADirection::forward;
}

int64_t validate_ep_counts(const TensorMeta& a, int64_t num_ep) {
  check_num_ep(num_ep);
  require_rank(a, 2, "all_shards_tokens_per_expert");
  require_index_dtype(a, "all_shards_tokens_per_expert");
  if (a.dim(0) != num_ep) {
    bad("all_shards_tokens_per_expert: expected " + str(num_ep) + " rows (num_ep), got shape " +
        shape_str(a.shape));
  }
  const int64_t E = a.dim(1);
  if (E < 1) bad("num_experts: must be >= 1, got " + str(E));
  if (E % num_ep != 0) {
    bad("num_ep: num_experts=" + str(E) + " is not divisible by num_ep=" + str(num_ep));
  }
  return E / num_ep;
}

void validate_shard_id(int64_t shard_id, int64_t num_ep) {
  check_num_ep(num_ep);
  if (shard_id < 0 || shard_id >= num_ep) {
    bad("shard_id: must be in [0, num_ep=" + str(num_ep) + "), got " + str(shard_id));
  }
}

void validate_ragged_all_to_all(const std::vector<TensorMeta>& operand,
                                const std::vector<TensorMeta>& output_init,
                                const std::vector<TensorMeta>& input_offsets,
                                const std::vector<TensorMeta>& send_sizes,
                                const std::vector<TensorMeta>& output_offsets,
                                const std::vector<TensorMeta>& recv_sizes, int64_t num_ep,
                                bool allow_f64) {
  check_num_ep(num_ep);
  auto count = [&](size_t n, const char* what) {
    if (static_cast<int64_t>(n) != num_ep) {
      bad(std::string(what) + ": expected one tensor per rank (num_ep=" + str(num_ep) + "), got " +
          str(static_cast<int64_t>(n)));
    }
  };
  count(operand.size(), "operand");
  count(output_init.size(), "output_init");
  count(input_offsets.size(), "input_offsets");
  count(send_sizes.size(), "send_sizes");
  count(output_offsets.size(), "output_offsets");
  count(recv_sizes.size(), "recv_sizes");
  for (int64_t r = 0; r < num_ep; ++r) {
    const std::string rk = "[rank " + str(r) + "]";
    require_rank(operand[r], 2, "operand" + rk);
    require_rank(output_init[r], 2, "output_init" + rk);
    require_float_dtype(operand[r], "operand" + rk, allow_f64);
    if (operand[r].dtype != operand[0].dtype || operand[r].shape != operand[0].shape) {
      bad("operand" + rk + ": every rank must hold the same dtype and shape, got " +
          operand[r].describe() + " vs " + operand[0].describe());
    }
    if (output_init[r].dtype != operand[0].dtype) {
      bad("output_init" + rk + ": dtype " + std::string(dtype_name(output_init[r].dtype)) +
          " differs from the operand dtype " + std::string(dtype_name(operand[0].dtype)));
    }
    if (output_init[r].shape != output_init[0].shape) {
      bad("output_init" + rk + ": every rank must hold the same shape, got " +
          shape_str(output_init[r].shape) + " vs " + shape_str(output_init[0].shape));
    }
    if (output_init[r].dim(1) != operand[r].dim(1)) {
      bad("output_init" + rk + ": hidden size " + str(output_init[r].dim(1)) +
          " differs from the operand's " + str(operand[r].dim(1)));
    }
    const std::pair<const TensorMeta*, const char*> arrays[] = {
        {&input_offsets[r], "input_offsets"},
        {&send_sizes[r], "send_sizes"},
        {&output_offsets[r], "output_offsets"},
        {&recv_sizes[r], "recv_sizes"}};
    for (auto [m, name] : arrays) {
      require_shape(*m, {num_ep}, name + rk);
      require_index_dtype(*m, name + rk);
    }
  }
}

void check_ragged_a2a_arrays(const std::vector<std::vector<int64_t>>& in_off,
                             const std::vector<std::vector<int64_t>>& send,
                             const std::vector<std::vector<int64_t>>& out_off,
                             const std::vector<std::vector<int64_t>>& recv, int64_t operand_rows,
                             int64_t output_rows) {
  const int64_t P = static_cast<int64_t>(send.size());
  auto at = [](const char* name, int64_t rank, int64_t j) {
    return std::string(name) + "[rank " + str(rank) + "][" + str(j) + "]";
  };
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t j = 0; j < P; ++j) {
      if (send[s][j] < 0) bad(at("send_sizes", s, j) + ": must be >= 0, got " + str(send[s][j]));
      if (recv[s][j] < 0) bad(at("recv_sizes", s, j) + ": must be >= 0, got " + str(recv[s][j]));
      if (in_off[s][j] < 0) {
        bad(at("input_offsets", s, j) + ": must be >= 0, got " + str(in_off[s][j]));
      }
      if (out_off[s][j] < 0) {
        bad(at("output_offsets", s, j) + ": must be >= 0, got " + str(out_off[s][j]));
      }
    }
  }
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t d = 0; d < P; ++d) {
      if (recv[d][s] != send[s][d]) {
        bad("recv_sizes: rank " + str(d) + " expects " + str(recv[d][s]) + " rows from rank " +
            str(s) + ", which sends " + str(send[s][d]) + " (send_sizes)");
      }
      if (in_off[s][d] + send[s][d] > operand_rows) {
        bad("input_offsets: rank " + str(s) + " sends rows [" + str(in_off[s][d]) + ", " +
            str(in_off[s][d] + send[s][d]) + ") to rank " + str(d) + ", beyond the operand's " +
            str(operand_rows) + " rows");
      }
    }
  }
  for (int64_t d = 0; d < P; ++d) {
    int64_t total = 0;
    for (int64_t s = 0; s < P; ++s) total += recv[d][s];
    if (total > output_rows) {
      bad("recv_sizes: rank " + str(d) + " receives " + str(total) +
          " rows in all, more than its receive buffer of " + str(output_rows) +
          " rows (output rows R)");
    }
    // Destination ranges on rank d, as written by every source s.
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t lo = out_off[s][d], hi = lo + send[s][d];
      if (hi > output_rows) {
        bad("output_offsets: rank " + str(s) + " writes rows [" + str(lo) + ", " + str(hi) +
            ") of rank " + str(d) + "'s receive buffer of " + str(output_rows) + " rows");
      }
      if (hi > lo) ranges.emplace_back(lo, hi);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); ++k) {
      if (ranges[k].first < ranges[k - 1].second) {
        bad("output_offsets: destination ranges [" + str(ranges[k - 1].first) + ", " +
            str(ranges[k - 1].second) + ") and [" + str(ranges[k].first) + ", " +
            str(ranges[k].second) + ") overlap on rank " + str(d));
      }
    }
  }
}

void validate_local_permute_after_a2a(const TensorMeta& x_recv, const TensorMeta& a,
                                      int64_t shard_id, int64_t num_ep, bool allow_f64) {
  validate_ep_counts(a, num_ep);
  validate_shard_id(shard_id, num_ep);
  require_rank(x_recv, 2, "x_recv");
  require_float_dtype(x_recv, "x_recv", allow_f64);
}

void validate_local_unpermute_before_a2a(const TensorMeta& y, const TensorMeta& row_id_map,
                                         bool allow_f64) {
  require_rank(y, 2, "expert_outputs");
  require_float_dtype(y, "expert_outputs", allow_f64);
  require_shape(row_id_map, {y.dim(0)}, "row_id_map");
  if (row_id_map.dtype != DType::i32) {
    bad("row_id_map: unsupported dtype " + std::string(dtype_name(row_id_map.dtype)) +
        " (expected int32)");
  }
}

void validate_ep_shape(const EpShape& s) {
  if (s.batch < 0) bad("batch: must be >= 0, got " + str(s.batch));
  if (s.seq < 0) bad("seq: must be >= 0, got " + str(s.seq));
  if (s.topk < 1) bad("topk: must be >= 1, got " + str(s.topk));
  check_num_ep(s.num_ep);
  if (s.dp < 1) bad("dp_size: must be >= 1, got " + str(s.dp));
  if (s.num_experts < 1) bad("num_experts: must be >= 1, got " + str(s.num_experts));
  if (s.align_size < 0) bad("align_size: must be >= 0, got " + str(s.align_size));
  if (s.num_experts % s.num_ep != 0) {
    bad("num_ep: num_experts=" + str(s.num_experts) +
        " is not divisible by num_ep=" + str(s.num_ep));
  }
  if (s.batch % (s.num_ep * s.dp) != 0) {
    bad("batch: B=" + str(s.batch) + " is not divisible by num_ep*dp_size=" + str(s.num_ep * s.dp) +
        " (num_ep=" + str(s.num_ep) + ", dp_size=" + str(s.dp) + ")");
  }
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (s.batch * s.seq > kMax / s.topk) bad("batch: B*S*K exceeds the int32 row range");
}

int64_t shard_rows(const EpShape& s) {
  validate_ep_shape(s);
  return s.batch / (s.num_ep * s.dp) * s.seq * s.topk;
}

int64_t pre_a2a_rows(const EpShape& s) {
  const int64_t n = shard_rows(s);
  return s.align_size > 0 ? n + s.num_experts * (s.align_size - 1) : n;
}

int64_t recv_rows(const EpShape& s) {
  validate_ep_shape(s);
  const int64_t n = s.batch / s.dp * s.seq * s.topk;
  return s.align_size > 0 ? n + s.num_experts * (s.align_size - 1) : n;
}

}  // namespace moe

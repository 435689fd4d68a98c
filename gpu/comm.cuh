// Communicator for the expert-parallel exchange (SPEC §9.3). The interface is the per-rank view
// an SPMD program has: each rank passes its own send buffer, its own receive buffer and its own
// four [P] int32 arrays (input_offsets, send_sizes, output_offsets, recv_sizes; output_offsets is
// sender-side: the row of rank j's buffer where this rank's chunk lands).
//
// A call lists the ranks this process drives, in ascending rank order:
//   InProcessCommunicator (this file): all P ranks, their buffers on one GPU, exchanged with one
//     gather kernel, so any EP size runs on one device.
//   an NCCL communicator (a later issue): exactly one rank per process, ncclSend/ncclRecv of each
//     chunk inside ncclGroupStart/End; the arrays are device memory, copied to the host for the
//     counts, and a receiver learns where its chunks land through all_to_all_i32.
// No CUDA types here: host C++ includes this header.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/runtime.cuh"

namespace moe::gpu {

// One rank's arguments to a ragged all-to-all. Rows are row_bytes wide; arrays are device int32
// [P]. After the collective, for every source s and destination d:
//   recv_d[out_off_s[d] : +send_s[d]) = send_s[in_off_s[d] : +send_s[d])
// and rows of recv no chunk covers keep their contents.
struct RaggedA2ARank {
  int rank = 0;
  const void* send = nullptr;
  int64_t send_rows = 0;
  void* recv = nullptr;
  int64_t recv_rows = 0;
  const int32_t* input_offsets = nullptr;
  const int32_t* send_sizes = nullptr;
  const int32_t* output_offsets = nullptr;
  const int32_t* recv_sizes = nullptr;
};

// One rank's arguments to a uniform all-to-all of `count` int32 per peer:
//   recv_r[j*count + c] = send_j[r*count + c]
struct AllToAllI32Rank {
  int rank = 0;
  const int32_t* send = nullptr;  // [P*count]
  int32_t* recv = nullptr;        // [P*count]
};

// One rank's arguments to an all-gather of `bytes` per rank:
//   recv_r[j*bytes : (j+1)*bytes] = send_j[0 : bytes)
// The moe_block uses it for everything global under EP across processes: the aux loss's logits,
// y, the routing map and probs, grad x and the per-shard gate-kernel gradients.
struct AllGatherRank {
  int rank = 0;
  const void* send = nullptr;  // [bytes]
  void* recv = nullptr;        // [P*bytes]
};

// Faults of a ragged all-to-all, raised through the device error flag (codes disjoint from
// PermFault). Values are packed: pair(x, y) = x << 20 | y, two int32 v1, v2 as v1 << 32 | v2.
enum class A2AFault : int32_t {
  negative = 101,       // a = kind << 40 | pair(rank, j) (kind 0 send, 1 recv, 2 in, 3 out)
  recv_mismatch = 102,  // a = pair(d, s), b = (recv_d[s], send_s[d])
  input_range = 103,    // a = pair(s, d), b = (lo, hi); beyond the send buffer
  recv_total = 104,     // a = d, b = rows d receives in all (more than recv_rows: R3)
  output_range = 105,   // a = pair(s, d), b = (lo, hi); beyond d's receive buffer
  overlap = 106,        // a = d, b = (s1, s2): the destination ranges of s1 and s2 overlap
  rank_table = 107,     // a = position, b = rank (the call's rank list is not 0..P-1)
};

// Throws std::invalid_argument naming the array (send_sizes, recv_sizes, input_offsets,
// output_offsets), ranks and values, in the words of check_ragged_a2a_arrays. send_rows and
// recv_rows complete the message. Does nothing for code 0; throws nothing for foreign codes.
void throw_if_a2a_fault(const DeviceError& e, int64_t send_rows, int64_t recv_rows);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  // The ranks this process drives, ascending.
  virtual std::vector<int> local_ranks() const = 0;
  // The ragged exchange. ranks: one entry per local rank, ascending. err: device error flag
  // (ErrorFlag::device_ptr) or null. With a fault in the arrays (negative sizes, mismatched
  // recv/send sizes, a range outside a buffer, an undersized receive buffer, overlapping
  // destinations) the fault is raised and no row is written anywhere. Stream-ordered; no sync.
  virtual void ragged_all_to_all(const std::vector<RaggedA2ARank>& ranks, int64_t row_bytes,
                                 void* err, Stream s) = 0;
  // Uniform exchange of count int32 per peer (small control data: offsets).
  virtual void all_to_all_i32(const std::vector<AllToAllI32Rank>& ranks, int64_t count,
                              Stream s) = 0;
  // All-gather of equal byte blocks (pure data movement, so bitwise the same on every
  // implementation). Stream-ordered; no sync.
  virtual void all_gather(const std::vector<AllGatherRank>& ranks, int64_t bytes, Stream s) = 0;
};

// P simulated ranks whose buffers all live on the current GPU.
class InProcessCommunicator final : public Communicator {
 public:
  static constexpr int kMaxRanks = 32;  // the rank table travels as a kernel parameter
  explicit InProcessCommunicator(int num_ranks);
  int size() const override { return size_; }
  std::vector<int> local_ranks() const override;
  void ragged_all_to_all(const std::vector<RaggedA2ARank>& ranks, int64_t row_bytes, void* err,
                         Stream s) override;
  void all_to_all_i32(const std::vector<AllToAllI32Rank>& ranks, int64_t count, Stream s) override;
  void all_gather(const std::vector<AllGatherRank>& ranks, int64_t bytes, Stream s) override;

 private:
  int size_;
};

}  // namespace moe::gpu

// NCCL communicator for the expert-parallel exchange (SPEC §9.3 on real GPUs): exactly one rank
// per process, one GPU per rank. Implements gpu/comm.cuh's Communicator, so code written against
// the in-process communicator runs unchanged across processes and nodes.
//
// ragged_all_to_all on rank r (NCCL has no all-to-all-v):
//   1. control: r packs its four [P] arrays and its buffer row counts into one int32 packet and
//      sends it to every peer with all_to_all_i32 (one ncclSend/ncclRecv group), so every rank
//      holds every rank's arrays; in particular a receiver learns where each of its chunks lands
//      (output_offsets is sender-side). The table comes to the host (one stream sync: NCCL
//      needs the counts on the host).
//   2. check: every rank runs the in-process communicator's checks, in its order, on the same
//      table, so every rank finds the same fault (or none). A fault is raised through the caller's
//      device error flag with the A2AFault codes (throw_if_a2a_fault words) and no row moves on
//      any rank: no rank is left waiting in a send its peer skipped.
//   3. data: ncclSend/ncclRecv of every non-empty chunk, the rank's own chunk included, inside
//      one ncclGroupStart/ncclGroupEnd on the caller's stream.
// The backward is the same call with the reverse-direction arrays (the adjoint exchange).
//
// Bootstrap (NcclBootstrap::from_env): MOE_RANK, MOE_WORLD_SIZE, MOE_LOCAL_RANK (the GPU,
// cudaSetDevice), and the NCCL unique id from MOE_NCCL_ID (hex) or MOE_NCCL_ID_FILE (rank 0
// writes it atomically by rename; the others poll it, MOE_NCCL_ID_TIMEOUT seconds, default 120;
// rank 0 deletes it once every rank has joined). `moe-harness launch` sets all of these.
// NVLink SHARP (multicast objects) is never used: NCCL_NVLS_ENABLE=0 is forced before init.
//
// Errors: a failing NCCL or CUDA call aborts the communicator (ncclCommAbort) and throws
// NcclError naming the rank and the call; every later call throws too. Host waits poll the
// stream and NCCL's asynchronous error, and give up after MOE_NCCL_TIMEOUT seconds (default 300)
// when a peer never arrives. Not thread-safe: one host thread drives a communicator.
//
// No CUDA or NCCL types here: host C++ includes this header. The definitions exist only in
// builds with NCCL (MOE_WITH_NCCL, set by CMake when nccl.h and libnccl are found).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/comm.cuh"
#include "gpu/runtime.cuh"

namespace moe::gpu {

class NcclError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct NcclBootstrap {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;   // the CUDA device of this rank
  std::string id_hex;   // the unique id as hex (MOE_NCCL_ID); wins over id_file
  std::string id_file;  // path rank 0 writes the id to (MOE_NCCL_ID_FILE)
  double id_timeout_s = 120;
  double op_timeout_s = 300;  // host waits inside collectives (MOE_NCCL_TIMEOUT)

  // Reads the variables above; throws std::invalid_argument naming a missing or bad variable.
  // With neither id variable and world_size 1, rank 0 makes its own id.
  static NcclBootstrap from_env();
  // Whether MOE_WORLD_SIZE is set (a launcher started this process).
  static bool launched();
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const NcclBootstrap& b);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int size() const override;
  int rank() const;
  int device() const;
  std::vector<int> local_ranks() const override;  // {rank()}
  // A non-blocking stream on this rank's device, owned by the communicator.
  Stream stream() const;

  // ranks must hold exactly this process's rank. See the file comment for the protocol.
  void ragged_all_to_all(const std::vector<RaggedA2ARank>& ranks, int64_t row_bytes, void* err,
                         Stream s) override;
  void all_to_all_i32(const std::vector<AllToAllI32Rank>& ranks, int64_t count, Stream s) override;
  // ncclAllGather of bytes per rank.
  void all_gather(const std::vector<AllGatherRank>& ranks, int64_t bytes, Stream s) override;

  // The equal-count all-to-all of bytes_per_peer bytes per peer (the benchmark baseline):
  // ncclAlltoAll (throws std::invalid_argument when the library lacks it, see has_alltoall), or
  // with use_send_recv an ncclSend/ncclRecv group. Stream-ordered.
  void all_to_all_equal(const void* send, void* recv, size_t bytes_per_peer, Stream s,
                        bool use_send_recv = false);
  // Host-side reductions over all ranks (synchronising; for test verdicts and benchmark rows).
  int64_t all_reduce_sum(int64_t v);
  double all_reduce_max(double v);
  void barrier();

  // Whether an error aborted the communicator (every later call throws).
  bool aborted() const;
  // Aborts the communicator and throws NcclError("rank r: what: detail").
  [[noreturn]] void fail(const std::string& what, const std::string& detail);

  // The loaded library's version ("2.28.3") and whether it exports ncclAlltoAll (2.28+).
  static std::string library_version();
  static bool has_alltoall();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// nccl-tests style data for exchanges of 2-byte words (bf16 rows): word c of row k of rank src's
// send buffer is pattern(seed, src, k, c), and a receive buffer starts as
// pattern(seed, P + rank, k, c), so any rank computes what its buffer must hold from the arrays
// alone. Values are finite bf16 bit patterns (exponent never all ones).
void a2a_pattern_fill(void* buf, int64_t rows, int64_t row_bytes, uint64_t seed, int64_t src,
                      Stream s);
// Where one source's chunk lands in a receive buffer: rows [dst_row, dst_row + rows) come from
// rows [src_row, ...) of rank src.
struct A2AChunk {
  int64_t src = 0, src_row = 0, dst_row = 0, rows = 0;
};
// 2-byte words of recv (rank `rank` of P) that differ from the expected contents: the chunks
// from their sources' patterns, every other row its initial pattern. Synchronises s.
int64_t a2a_pattern_count_wrong(const void* recv, int64_t recv_rows, int64_t row_bytes,
                                uint64_t seed, int64_t rank, int64_t P,
                                const std::vector<A2AChunk>& chunks, Stream s);

// Times `iters` calls of fn (enqueued on s) with CUDA events, a barrier before each; returns
// the per-call microseconds of this rank.
std::vector<double> time_calls(NcclCommunicator& comm, Stream s, int iters,
                               const std::function<void()>& fn);

}  // namespace moe::gpu

// NCCL communicator (gpu/nccl_comm.cuh): protocol, bootstrap and error handling are described
// there. The whole file is empty in builds without NCCL (CMake defines MOE_WITH_NCCL when it finds
// nccl.h and libnccl).
#ifdef MOE_WITH_NCCL

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <nccl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "gpu/device_util.cuh"
#include "gpu/nccl_comm.cuh"

namespace moe::gpu {

namespace {

std::string str(int64_t v) {
  return std::to_string(v);
}

// NCCL reads its environment once, at its first call (ncclGetUniqueId included), so this runs
// before any. NVLink SHARP would create multicast objects: never on these machines.
void force_nccl_env() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v && std::string(v) != "0") {
    std::fprintf(stderr, "moe: NCCL_NVLS_ENABLE=%s overridden to 0 (multicast is not used)\n", v);
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);
}

int env_int(const char* name, int lo, int hi, const int* dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    if (dflt) return *dflt;
    throw std::invalid_argument(std::string(name) + ": not set (moe-harness launch sets it)");
  }
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(std::string(name) + ": expected an integer in [" + str(lo) + ", " +
                                str(hi) + "], got '" + v + "'");
  }
  return static_cast<int>(x);
}

double env_seconds(const char* name, double dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !(x > 0)) {
    throw std::invalid_argument(std::string(name) + ": expected seconds > 0, got '" + v + "'");
  }
  return x;
}

std::string to_hex(const ncclUniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    const auto b = static_cast<unsigned char>(id.internal[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

bool from_hex(std::string s, ncclUniqueId* id) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  if (s.size() != 2 * sizeof id->internal) return false;
  auto nib = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof id->internal; ++i) {
    const int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    id->internal[i] = static_cast<char>(hi << 4 | lo);
  }
  return true;
}

// Written under a temporary name, then renamed: a reader sees the whole id or no file.
void write_id_file(const std::string& path, const ncclUniqueId& id) {
  const std::string tmp = path + ".tmp." + str(getpid());
  const std::string hex = to_hex(id) + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  bool ok = fd >= 0 && ::write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size());
  ok = ok && ::fsync(fd) == 0;
  if (fd >= 0) ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw std::runtime_error("rank 0: cannot write MOE_NCCL_ID_FILE=" + path + ": " + why);
  }
}

ncclUniqueId read_id_file(const std::string& path, int rank, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path);
    if (f) {
      std::stringstream ss;
      ss << f.rdbuf();
      ncclUniqueId id;
      if (from_hex(ss.str(), &id)) return id;
      throw std::invalid_argument("MOE_NCCL_ID_FILE: " + path + " does not hold a " +
                                  str(2 * sizeof id.internal) + "-digit hex NCCL id");
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
      throw std::runtime_error("rank " + str(rank) + ": MOE_NCCL_ID_FILE=" + path +
                               " did not appear within " + str(static_cast<int64_t>(timeout_s)) +
                               " s (rank 0 writes it; MOE_NCCL_ID_TIMEOUT)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The control packet of one rank (int32): its four [P] arrays, then send_rows, recv_rows and
// row_bytes as (high, low) halves, then a word of caller faults that every rank must learn of
// (kNullSend, kNullRecv: a null buffer with rows to move), so all ranks throw alike.
enum Field : int { kSend = 0, kRecv = 1, kIn = 2, kOut = 3 };
constexpr int32_t kNullSend = 1, kNullRecv = 2;
__host__ __device__ int packet_ints(int P) {
  return 4 * P + 7;
}

// Rank r's packet, written once per peer (the all_to_all_i32 that follows is then an all-gather).
__global__ void pack_kernel(int P, const int32_t* send, const int32_t* recv, const int32_t* in,
                            const int32_t* out, long long send_rows, long long recv_rows,
                            long long row_bytes, int32_t flags, int32_t* packets) {
  const int C = packet_ints(P);
  for (int i = threadIdx.x; i < P * C; i += blockDim.x) {
    const int k = i % C;
    int32_t v;
    if (k < 4 * P) {
      const int32_t* arr[4] = {send, recv, in, out};
      v = arr[k / P][k % P];
    } else if (k == C - 1) {
      v = flags;
    } else {
      const long long rows[3] = {send_rows, recv_rows, row_bytes};
      const long long x = rows[(k - 4 * P) / 2];
      v = ((k - 4 * P) % 2 == 0) ? static_cast<int32_t>(x >> 32) : static_cast<int32_t>(x);
    }
    packets[i] = v;
  }
}

__global__ void raise_kernel(void* err, int32_t code, long long a, long long b) {
  raise_error(err, code, a, b);
}

// Every rank's arrays, as gathered.
struct Table {
  int P = 0;
  std::vector<int32_t> raw;  // [P][packet_ints(P)]
  int64_t at(int r, Field f, int j) const {
    return raw[static_cast<size_t>(r) * packet_ints(P) + f * P + j];
  }
  int64_t wide(int r, int which) const {  // 0 send_rows, 1 recv_rows, 2 row_bytes
    const size_t base = static_cast<size_t>(r) * packet_ints(P) + 4 * P + 2 * which;
    return (static_cast<int64_t>(raw[base]) << 32) | static_cast<uint32_t>(raw[base + 1]);
  }
  int32_t flags(int r) const { return raw[static_cast<size_t>(r + 1) * packet_ints(P) - 1]; }
};

long long pair(long long x, long long y) {
  return (x << 20) | y;
}
long long two(long long v1, long long v2) {
  return (v1 << 32) | (v2 & 0xffffffffLL);
}

// The in-process communicator's checks (gpu/comm.cu, a2a_check_kernel), in its order and with
// its codes and packing; where several entries fail, the lowest (rank, peer) is reported.
DeviceError check_table(const Table& t) {
  const int P = t.P;
  for (int r = 0; r < P; ++r) {
    for (int j = 0; j < P; ++j) {
      const Field kinds[4] = {kSend, kRecv, kIn, kOut};
      for (int kind = 0; kind < 4; ++kind) {
        const int64_t v = t.at(r, kinds[kind], j);
        if (v < 0) {
          return {static_cast<int32_t>(A2AFault::negative),
                  (static_cast<long long>(kind) << 40) | pair(r, j), v};
        }
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < P; ++d) {
      const int64_t send = t.at(s, kSend, d), recv = t.at(d, kRecv, s), lo = t.at(s, kIn, d);
      if (recv != send) {
        return {static_cast<int32_t>(A2AFault::recv_mismatch), pair(d, s), two(recv, send)};
      }
      if (lo + send > t.wide(s, 0)) {
        return {static_cast<int32_t>(A2AFault::input_range), pair(s, d), two(lo, lo + send)};
      }
    }
  }
  for (int d = 0; d < P; ++d) {
    const int64_t recv_rows = t.wide(d, 1);
    int64_t total = 0;
    for (int s = 0; s < P; ++s) total += t.at(d, kRecv, s);
    if (total > recv_rows) return {static_cast<int32_t>(A2AFault::recv_total), d, total};
    for (int s = 0; s < P; ++s) {
      const int64_t lo = t.at(s, kOut, d), hi = lo + t.at(s, kSend, d);
      if (hi > recv_rows) {
        return {static_cast<int32_t>(A2AFault::output_range), pair(s, d), two(lo, hi)};
      }
    }
    for (int s1 = 0; s1 < P; ++s1) {
      const int64_t lo1 = t.at(s1, kOut, d), hi1 = lo1 + t.at(s1, kSend, d);
      for (int s2 = s1 + 1; s2 < P; ++s2) {
        const int64_t lo2 = t.at(s2, kOut, d), hi2 = lo2 + t.at(s2, kSend, d);
        if (hi1 > lo1 && hi2 > lo2 && lo1 < hi2 && lo2 < hi1) {
          return {static_cast<int32_t>(A2AFault::overlap), d, two(s1, s2)};
        }
      }
    }
  }
  return {};
}

void check_single_rank(const std::vector<int>& ids, int rank, const char* what) {
  if (ids.size() != 1 || ids[0] != rank) {
    std::string got;
    for (int r : ids) got += (got.empty() ? "" : ",") + str(r);
    throw std::invalid_argument(std::string("ranks: an NCCL ") + what +
                                " takes this process's rank only (" + str(rank) + "), got [" + got +
                                "]");
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Bootstrap

bool NcclBootstrap::launched() {
  const char* v = std::getenv("MOE_WORLD_SIZE");
  return v && *v;
}

NcclBootstrap NcclBootstrap::from_env() {
  NcclBootstrap b;
  b.world_size = env_int("MOE_WORLD_SIZE", 1, 1 << 20, nullptr);
  b.rank = env_int("MOE_RANK", 0, b.world_size - 1, nullptr);
  b.local_rank = env_int("MOE_LOCAL_RANK", 0, 1 << 16, &b.rank);
  if (const char* v = std::getenv("MOE_NCCL_ID")) b.id_hex = v;
  if (const char* v = std::getenv("MOE_NCCL_ID_FILE")) b.id_file = v;
  b.id_timeout_s = env_seconds("MOE_NCCL_ID_TIMEOUT", b.id_timeout_s);
  b.op_timeout_s = env_seconds("MOE_NCCL_TIMEOUT", b.op_timeout_s);
  if (b.id_hex.empty() && b.id_file.empty() && b.world_size > 1) {
    throw std::invalid_argument(
        "MOE_NCCL_ID_FILE: neither it nor MOE_NCCL_ID is set for a world of " + str(b.world_size) +
        " ranks (moe-harness launch sets MOE_NCCL_ID_FILE)");
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// Communicator

struct NcclCommunicator::Impl {
  int rank = 0, size = 1, device = 0;
  double op_timeout_s = 300;
  ncclComm_t comm = nullptr;
  bool aborted = false, in_group = false;
  cudaStream_t stream = nullptr;
  // Control exchange staging: packets to send and received ([P][C] int32), and the host table.
  int32_t* d_packets_out = nullptr;
  int32_t* d_packets_in = nullptr;
  int32_t* h_packets = nullptr;
  // Host reductions: 8 bytes each way.
  void* d_scalar = nullptr;
  void* h_scalar = nullptr;
};

void NcclCommunicator::fail(const std::string& what, const std::string& detail) {
  if (impl_->in_group) {
    impl_->in_group = false;
    ncclGroupEnd();  // leave NCCL's group state before the abort; its result is moot now
  }
  if (impl_->comm && !impl_->aborted) ncclCommAbort(impl_->comm);
  impl_->aborted = true;
  impl_->comm = nullptr;
  const std::string msg = "rank " + str(impl_->rank) + ": " + what + ": " + detail;
  std::fprintf(stderr, "moe: %s (communicator aborted)\n", msg.c_str());
  throw NcclError(msg);
}

// Call-site helpers: the failing call's text goes into the message.
#define MOE_NCCL_TRY(self, call)                                 \
  do {                                                           \
    const ncclResult_t r_ = (call);                              \
    if (r_ != ncclSuccess) {                                     \
      std::string d_ = ncclGetErrorString(r_);                   \
      if (const char* l_ = ncclGetLastError(nullptr); l_ && *l_) \
        d_ += std::string(" (") + l_ + ")";                      \
      (self).fail(#call, d_);                                    \
    }                                                            \
  } while (0)
#define MOE_CUDA_TRY(self, call)                                                                   \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      (self).fail(#call, std::string(cudaGetErrorName(e_)) + " (" + cudaGetErrorString(e_) + ")"); \
    }                                                                                              \
  } while (0)

NcclCommunicator::NcclCommunicator(const NcclBootstrap& b) : impl_(std::make_unique<Impl>()) {
  force_nccl_env();
  if (b.world_size < 1) {
    throw std::invalid_argument("MOE_WORLD_SIZE: must be >= 1, got " + str(b.world_size));
  }
  if (b.rank < 0 || b.rank >= b.world_size) {
    throw std::invalid_argument("MOE_RANK: must be in [0, " + str(b.world_size) + "), got " +
                                str(b.rank));
  }
  const int ndev = device_count();
  if (b.local_rank < 0 || b.local_rank >= ndev) {
    throw std::invalid_argument("MOE_LOCAL_RANK: rank " + str(b.rank) + " wants device " +
                                str(b.local_rank) + ", but " + str(ndev) +
                                " CUDA devices are visible");
  }
  Impl& m = *impl_;
  m.rank = b.rank;
  m.size = b.world_size;
  m.device = b.local_rank;
  m.op_timeout_s = b.op_timeout_s;
  MOE_CUDA_TRY(*this, cudaSetDevice(m.device));

  ncclUniqueId id;
  if (!b.id_hex.empty()) {
    if (!from_hex(b.id_hex, &id)) {
      throw std::invalid_argument("MOE_NCCL_ID: expected " + str(2 * sizeof id.internal) +
                                  " hex digits, got " + str(b.id_hex.size()) + " characters");
    }
  } else if (b.rank == 0) {
    MOE_NCCL_TRY(*this, ncclGetUniqueId(&id));
    if (!b.id_file.empty()) write_id_file(b.id_file, id);
  } else {
    id = read_id_file(b.id_file, b.rank, b.id_timeout_s);
  }
  {
    const ncclResult_t r = ncclCommInitRank(&m.comm, m.size, id, m.rank);
    if (r != ncclSuccess) {
      m.comm = nullptr;
      fail("ncclCommInitRank(" + str(m.size) + " ranks)", ncclGetErrorString(r));
    }
  }
  // Every rank has read the id once the communicator exists: no stale file for the next job.
  if (b.rank == 0 && b.id_hex.empty() && !b.id_file.empty()) ::unlink(b.id_file.c_str());

  MOE_CUDA_TRY(*this, cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  const size_t packets = static_cast<size_t>(m.size) * packet_ints(m.size) * sizeof(int32_t);
  MOE_CUDA_TRY(*this, cudaMalloc(&m.d_packets_out, packets));
  MOE_CUDA_TRY(*this, cudaMalloc(&m.d_packets_in, packets));
  MOE_CUDA_TRY(*this, cudaMallocHost(&m.h_packets, packets));
  MOE_CUDA_TRY(*this, cudaMalloc(&m.d_scalar, 16));
  MOE_CUDA_TRY(*this, cudaMallocHost(&m.h_scalar, 16));
}

NcclCommunicator::~NcclCommunicator() {
  Impl& m = *impl_;
  if (m.comm) {
    // A clean exit waits for this rank's work; ncclCommDestroy then frees the resources.
    if (m.stream) cudaStreamSynchronize(m.stream);
    ncclCommDestroy(m.comm);
  }
  if (m.stream) cudaStreamDestroy(m.stream);
  cudaFree(m.d_packets_out);
  cudaFree(m.d_packets_in);
  cudaFreeHost(m.h_packets);
  cudaFree(m.d_scalar);
  cudaFreeHost(m.h_scalar);
}

int NcclCommunicator::size() const {
  return impl_->size;
}
int NcclCommunicator::rank() const {
  return impl_->rank;
}
int NcclCommunicator::device() const {
  return impl_->device;
}
std::vector<int> NcclCommunicator::local_ranks() const {
  return {impl_->rank};
}
Stream NcclCommunicator::stream() const {
  return impl_->stream;
}
bool NcclCommunicator::aborted() const {
  return impl_->aborted;
}

std::string NcclCommunicator::library_version() {
  force_nccl_env();
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // Codes since 2.9: major*10000 + minor*100 + patch.
  return str(v / 10000) + "." + str(v / 100 % 100) + "." + str(v % 100);
}

namespace {

// ncclAlltoAll appeared in NCCL 2.28. It is looked up in the loaded library rather than linked,
// so a binary built against newer headers still loads with an older libnccl.
using AlltoAllFn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                                    cudaStream_t);
AlltoAllFn alltoall_fn() {
  static const AlltoAllFn f = reinterpret_cast<AlltoAllFn>(dlsym(RTLD_DEFAULT, "ncclAlltoAll"));
  return f;
}

}  // namespace

bool NcclCommunicator::has_alltoall() {
  return alltoall_fn() != nullptr;
}

namespace {

// Waits for s while watching NCCL's asynchronous error and the deadline: a rank whose peer died
// fails with a message instead of blocking forever.
void wait_stream(NcclCommunicator& c, ncclComm_t comm, cudaStream_t s, double timeout_s,
                 const char* what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int spin = 0;; ++spin) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      c.fail(std::string(what) + " (stream wait)",
             std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")");
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      c.fail(std::string(what) + " (asynchronous NCCL error)", ncclGetErrorString(async));
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > timeout_s) {
      c.fail(what, "no progress in " + str(static_cast<int64_t>(timeout_s)) +
                       " s: a peer rank is missing or stuck (MOE_NCCL_TIMEOUT)");
    }
    if (spin < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace

void NcclCommunicator::all_to_all_i32(const std::vector<AllToAllI32Rank>& ranks, int64_t count,
                                      Stream s) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_single_rank(ids, m.rank, "all_to_all_i32");
  if (count < 0) throw std::invalid_argument("count: must be >= 0, got " + str(count));
  if (count == 0) return;
  const AllToAllI32Rank& r = ranks[0];
  if (!r.send || !r.recv) throw std::invalid_argument("all_to_all_i32: null send or recv buffer");
  const size_t n = static_cast<size_t>(count);
  MOE_NCCL_TRY(*this, ncclGroupStart());
  m.in_group = true;
  for (int j = 0; j < m.size; ++j) {
    MOE_NCCL_TRY(*this, ncclSend(r.send + j * n, n, ncclInt32, j, m.comm, s));
    MOE_NCCL_TRY(*this, ncclRecv(r.recv + j * n, n, ncclInt32, j, m.comm, s));
  }
  m.in_group = false;
  MOE_NCCL_TRY(*this, ncclGroupEnd());
}

void NcclCommunicator::all_gather(const std::vector<AllGatherRank>& ranks, int64_t bytes,
                                  Stream s) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_single_rank(ids, m.rank, "all_gather");
  if (bytes < 0) throw std::invalid_argument("bytes: must be >= 0, got " + str(bytes));
  if (bytes == 0) return;
  const AllGatherRank& r = ranks[0];
  if (!r.send || !r.recv) throw std::invalid_argument("all_gather: null send or recv buffer");
  MOE_NCCL_TRY(*this, ncclAllGather(r.send, r.recv, static_cast<size_t>(bytes), ncclUint8, m.comm,
                                    static_cast<cudaStream_t>(s)));
}

void NcclCommunicator::ragged_all_to_all(const std::vector<RaggedA2ARank>& ranks, int64_t row_bytes,
                                         void* err, Stream s) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_single_rank(ids, m.rank, "ragged_all_to_all");
  if (row_bytes < 0) throw std::invalid_argument("row_bytes: must be >= 0, got " + str(row_bytes));
  const RaggedA2ARank& me = ranks[0];
  if (!me.send_sizes || !me.recv_sizes || !me.input_offsets || !me.output_offsets) {
    throw std::invalid_argument("ragged_all_to_all: rank " + str(m.rank) +
                                " passes a null array (send_sizes, recv_sizes, input_offsets, "
                                "output_offsets are device int32 [P])");
  }
  if (me.send_rows < 0 || me.recv_rows < 0) {
    throw std::invalid_argument("ragged_all_to_all: rank " + str(m.rank) + " passes send_rows " +
                                str(me.send_rows) + ", recv_rows " + str(me.recv_rows));
  }
  const int P = m.size, C = packet_ints(P);
  int32_t flags = 0;
  if (row_bytes > 0 && me.send_rows > 0 && !me.send) flags |= kNullSend;
  if (row_bytes > 0 && me.recv_rows > 0 && !me.recv) flags |= kNullRecv;

  // 1. Control: every rank's packet to every rank.
  pack_kernel<<<1, 256, 0, s>>>(P, me.send_sizes, me.recv_sizes, me.input_offsets,
                                me.output_offsets, me.send_rows, me.recv_rows, row_bytes, flags,
                                m.d_packets_out);
  MOE_CUDA_TRY(*this, cudaGetLastError());
  all_to_all_i32({{m.rank, m.d_packets_out, m.d_packets_in}}, C, s);
  MOE_CUDA_TRY(*this, cudaMemcpyAsync(m.h_packets, m.d_packets_in,
                                      static_cast<size_t>(P) * C * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, s));
  wait_stream(*this, m.comm, s, m.op_timeout_s, "ragged_all_to_all control exchange");
  Table t;
  t.P = P;
  t.raw.assign(m.h_packets, m.h_packets + static_cast<size_t>(P) * C);

  // 2. Check, identically on every rank.
  for (int r = 0; r < P; ++r) {
    if (t.wide(r, 2) != row_bytes) {
      throw std::invalid_argument("row_bytes: rank " + str(r) + " moves rows of " +
                                  str(t.wide(r, 2)) + " bytes, rank " + str(m.rank) + " of " +
                                  str(row_bytes));
    }
    if (t.flags(r) != 0) {
      throw std::invalid_argument(std::string(t.flags(r) & kNullSend ? "send" : "recv") +
                                  ": rank " + str(r) + " passes a null buffer of " +
                                  str(t.wide(r, t.flags(r) & kNullSend ? 0 : 1)) + " rows");
    }
  }
  const DeviceError fault = check_table(t);
  if (fault.code != 0) {
    if (err) {
      raise_kernel<<<1, 1, 0, s>>>(err, fault.code, fault.a, fault.b);
      MOE_CUDA_TRY(*this, cudaGetLastError());
    }
    return;
  }
  if (row_bytes == 0) return;

  // 3. Data: one group of every non-empty chunk, this rank's own chunk included.
  bool any = false;
  for (int j = 0; j < P; ++j) any = any || t.at(m.rank, kSend, j) > 0 || t.at(m.rank, kRecv, j) > 0;
  if (!any) return;
  const auto* src = static_cast<const uint8_t*>(me.send);
  auto* dst = static_cast<uint8_t*>(me.recv);
  MOE_NCCL_TRY(*this, ncclGroupStart());
  m.in_group = true;
  for (int j = 0; j < P; ++j) {
    const int64_t send_n = t.at(m.rank, kSend, j), recv_n = t.at(m.rank, kRecv, j);
    if (send_n > 0) {
      MOE_NCCL_TRY(*this,
                   ncclSend(src + t.at(m.rank, kIn, j) * row_bytes,
                            static_cast<size_t>(send_n * row_bytes), ncclInt8, j, m.comm, s));
    }
    if (recv_n > 0) {
      // Sender-side offset: where rank j said this rank's chunk goes.
      MOE_NCCL_TRY(*this,
                   ncclRecv(dst + t.at(j, kOut, m.rank) * row_bytes,
                            static_cast<size_t>(recv_n * row_bytes), ncclInt8, j, m.comm, s));
    }
  }
  m.in_group = false;
  MOE_NCCL_TRY(*this, ncclGroupEnd());
}

void NcclCommunicator::all_to_all_equal(const void* send, void* recv, size_t bytes_per_peer,
                                        Stream s, bool use_send_recv) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  if (bytes_per_peer == 0) return;
  if (!use_send_recv) {
    const AlltoAllFn alltoall = alltoall_fn();
    if (!alltoall) {
      throw std::invalid_argument("all_to_all_equal: libnccl " + library_version() +
                                  " has no ncclAlltoAll (2.28+); use the send/recv form");
    }
    MOE_NCCL_TRY(*this, alltoall(send, recv, bytes_per_peer, ncclInt8, m.comm, s));
    return;
  }
  const auto* src = static_cast<const uint8_t*>(send);
  auto* dst = static_cast<uint8_t*>(recv);
  MOE_NCCL_TRY(*this, ncclGroupStart());
  m.in_group = true;
  for (int j = 0; j < m.size; ++j) {
    MOE_NCCL_TRY(*this, ncclSend(src + j * bytes_per_peer, bytes_per_peer, ncclInt8, j, m.comm, s));
    MOE_NCCL_TRY(*this, ncclRecv(dst + j * bytes_per_peer, bytes_per_peer, ncclInt8, j, m.comm, s));
  }
  m.in_group = false;
  MOE_NCCL_TRY(*this, ncclGroupEnd());
}

int64_t NcclCommunicator::all_reduce_sum(int64_t v) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  *static_cast<int64_t*>(m.h_scalar) = v;
  MOE_CUDA_TRY(*this, cudaMemcpyAsync(m.d_scalar, m.h_scalar, 8, cudaMemcpyHostToDevice, m.stream));
  MOE_NCCL_TRY(*this,
               ncclAllReduce(m.d_scalar, m.d_scalar, 1, ncclInt64, ncclSum, m.comm, m.stream));
  MOE_CUDA_TRY(*this, cudaMemcpyAsync(m.h_scalar, m.d_scalar, 8, cudaMemcpyDeviceToHost, m.stream));
  wait_stream(*this, m.comm, m.stream, m.op_timeout_s, "all_reduce_sum");
  return *static_cast<int64_t*>(m.h_scalar);
}

double NcclCommunicator::all_reduce_max(double v) {
  Impl& m = *impl_;
  if (m.aborted) throw NcclError("rank " + str(m.rank) + ": communicator aborted earlier");
  *static_cast<double*>(m.h_scalar) = v;
  MOE_CUDA_TRY(*this, cudaMemcpyAsync(m.d_scalar, m.h_scalar, 8, cudaMemcpyHostToDevice, m.stream));
  MOE_NCCL_TRY(*this,
               ncclAllReduce(m.d_scalar, m.d_scalar, 1, ncclFloat64, ncclMax, m.comm, m.stream));
  MOE_CUDA_TRY(*this, cudaMemcpyAsync(m.h_scalar, m.d_scalar, 8, cudaMemcpyDeviceToHost, m.stream));
  wait_stream(*this, m.comm, m.stream, m.op_timeout_s, "all_reduce_max");
  return *static_cast<double*>(m.h_scalar);
}

void NcclCommunicator::barrier() {
  all_reduce_sum(0);
}

// ---------------------------------------------------------------------------------------------
// Pattern data and timing (benchmarks, large tests)

namespace {

__device__ __forceinline__ uint16_t pattern_word(unsigned long long seed, long long src,
                                                 long long row, long long col) {
  unsigned long long x = seed ^ (static_cast<unsigned long long>(src) * 0x9E3779B97F4A7C15ull);
  x ^= static_cast<unsigned long long>(row) * 0xC2B2AE3D27D4EB4Full;
  x ^= static_cast<unsigned long long>(col) * 0x165667B19E3779F9ull;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint16_t>(x) & 0xBFFF;  // bf16 exponent never all ones: finite values
}

__global__ void pattern_fill_kernel(uint16_t* buf, long long rows, long long words,
                                    unsigned long long seed, long long src) {
  const long long n = rows * words;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    buf[i] = pattern_word(seed, src, i / words, i % words);
  }
}

constexpr int kMaxChunks = 64;
struct ChunkTable {
  int n;
  long long src[kMaxChunks], src_row[kMaxChunks], dst_row[kMaxChunks], rows[kMaxChunks];
};

__global__ void pattern_verify_kernel(const uint16_t* buf, long long rows, long long words,
                                      unsigned long long seed, long long init_src,
                                      const __grid_constant__ ChunkTable tb,
                                      unsigned long long* wrong) {
  const long long n = rows * words;
  unsigned long long bad = 0;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long row = i / words, col = i % words;
    long long src = init_src, src_row = row;
    for (int c = 0; c < tb.n; ++c) {
      if (row >= tb.dst_row[c] && row < tb.dst_row[c] + tb.rows[c]) {
        src = tb.src[c];
        src_row = tb.src_row[c] + (row - tb.dst_row[c]);
        break;
      }
    }
    bad += buf[i] != pattern_word(seed, src, src_row, col);
  }
  for (int o = 16; o > 0; o /= 2) bad += __shfl_down_sync(0xffffffffu, bad, o);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(wrong, bad);
}

unsigned grid_of(long long n) {
  int dev = 0, sms = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const long long want = (n + 255) / 256;
  const long long cap = static_cast<long long>(sms) * 16;
  return static_cast<unsigned>(std::max(1LL, std::min(want, cap)));
}

int64_t words_of(int64_t row_bytes) {
  if (row_bytes < 0 || row_bytes % 2 != 0) {
    throw std::invalid_argument("row_bytes: pattern rows are 2-byte words, got " + str(row_bytes));
  }
  return row_bytes / 2;
}

}  // namespace

void a2a_pattern_fill(void* buf, int64_t rows, int64_t row_bytes, uint64_t seed, int64_t src,
                      Stream s) {
  const int64_t words = words_of(row_bytes);
  if (rows <= 0 || words == 0) return;
  pattern_fill_kernel<<<grid_of(rows * words), 256, 0, s>>>(static_cast<uint16_t*>(buf), rows,
                                                            words, seed, src);
  MOE_CUDA_CHECK(cudaGetLastError());
}

int64_t a2a_pattern_count_wrong(const void* recv, int64_t recv_rows, int64_t row_bytes,
                                uint64_t seed, int64_t rank, int64_t P,
                                const std::vector<A2AChunk>& chunks, Stream s) {
  const int64_t words = words_of(row_bytes);
  if (static_cast<int>(chunks.size()) > kMaxChunks) {
    throw std::invalid_argument("chunks: at most " + str(kMaxChunks) + ", got " +
                                str(static_cast<int64_t>(chunks.size())));
  }
  if (recv_rows <= 0 || words == 0) return 0;
  ChunkTable tb{};
  tb.n = static_cast<int>(chunks.size());
  for (int c = 0; c < tb.n; ++c) {
    tb.src[c] = chunks[c].src;
    tb.src_row[c] = chunks[c].src_row;
    tb.dst_row[c] = chunks[c].dst_row;
    tb.rows[c] = chunks[c].rows;
  }
  unsigned long long* d_wrong = nullptr;
  MOE_CUDA_CHECK(cudaMallocAsync(&d_wrong, sizeof *d_wrong, s));
  MOE_CUDA_CHECK(cudaMemsetAsync(d_wrong, 0, sizeof *d_wrong, s));
  pattern_verify_kernel<<<grid_of(recv_rows * words), 256, 0, s>>>(
      static_cast<const uint16_t*>(recv), recv_rows, words, seed, P + rank, tb, d_wrong);
  MOE_CUDA_CHECK(cudaGetLastError());
  unsigned long long wrong = 0;
  MOE_CUDA_CHECK(cudaMemcpyAsync(&wrong, d_wrong, sizeof wrong, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaFreeAsync(d_wrong, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return static_cast<int64_t>(wrong);
}

std::vector<double> time_calls(NcclCommunicator& comm, Stream s, int iters,
                               const std::function<void()>& fn) {
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(std::max(iters, 0)));
  for (auto& e : ev) MOE_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> us;
  try {
    for (int i = 0; i < iters; ++i) {
      comm.barrier();
      MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i], s));
      fn();
      MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s));
      MOE_CUDA_CHECK(cudaEventSynchronize(ev[2 * i + 1]));
      float ms = 0;
      MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      us.push_back(1000.0 * ms);
    }
  } catch (...) {
    for (auto& e : ev) cudaEventDestroy(e);
    throw;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return us;
}

}  // namespace moe::gpu

#endif  // MOE_WITH_NCCL

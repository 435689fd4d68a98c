// Kernel timelines: which kernels, copies and memsets a call put on the GPU, when each ran and on
// which stream, and the stage of our host code that issued it. `moe-harness bench --timeline`
// records one call of each case this way (tools/timeline.h summarises and writes it), so a row's
// time splits into its stages and the GPU's idle gaps; the issue #20 question "which stage of
// the block is furthest from its roofline" is answered from one run.
//
// The recorder is CUPTI's activity API, loaded at run time (dlopen, so nothing links against it
// and a machine without it runs everything else): kernels and copies come with GPU timestamps
// from concurrent-kernel records, and each API call made inside a TimelineStage carries that
// stage's path through CUPTI's external correlation ids. Outside a recording, a TimelineStage
// costs a thread-local push and pop and makes no CUPTI call.
//
// This header has no CUDA types, so host C++ (tools, tests) can include it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::gpu {

// One piece of GPU work: a kernel, a copy or a memset.
struct TimelineEvent {
  std::string kind;   // "kernel", "memcpy" or "memset"
  std::string name;   // demangled kernel name, or "memcpy DtoD" / "memset"
  std::string stage;  // the TimelineStage path that issued it ("experts/ffn.act"); "" if none
  uint32_t device = 0, stream = 0;
  uint64_t start_ns = 0, end_ns = 0;                  // GPU timestamps
  uint64_t bytes = 0;                                 // copies and memsets
  int32_t grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};  // kernels
  uint32_t registers = 0, shared_bytes = 0;           // kernels: per thread; static + dynamic
};

// Names the GPU work the enclosing scope issues, for a recording in progress. Nested stages
// join their names with '/'. A stage opened before the recording started names only the paths of
// the stages opened inside it (its own work is recorded under no stage). The name must outlive
// the scope (a string literal).
class TimelineStage {
 public:
  explicit TimelineStage(const char* name);
  ~TimelineStage();
  TimelineStage(const TimelineStage&) = delete;
  TimelineStage& operator=(const TimelineStage&) = delete;

 private:
  bool pushed_ = false;
};

// Whether a recording can start here: empty if so, else why not ("libcupti.so.13 not found
// (set MOE_CUPTI_LIB to its path)", "built without cupti.h"). Loads CUPTI on first use.
std::string timeline_unavailable();

// One recording at a time, of every device this process uses. start() throws
// std::runtime_error when CUPTI is unavailable or refuses (e.g. another profiler holds it);
// stop() waits for the device, flushes CUPTI's buffers and returns the work issued between the
// two, by start time. A recording left running is stopped by the destructor.
class TimelineRecording {
 public:
  TimelineRecording();
  ~TimelineRecording();
  TimelineRecording(const TimelineRecording&) = delete;
  TimelineRecording& operator=(const TimelineRecording&) = delete;
  std::vector<TimelineEvent> stop();

 private:
  bool running_ = false;
};

}  // namespace moe::gpu

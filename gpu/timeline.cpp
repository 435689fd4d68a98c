// CUPTI-based kernel timelines (gpu/timeline.cuh). CUPTI is loaded with dlopen and its entry
// points looked up by name, so the library does not link against it: where it is missing only
// a recording fails, naming what it looked for. scripts/cupti_trace.cpp records the same activity
// kinds for a whole process from outside (LD_PRELOAD, CSV at exit, API calls too); this one is
// in process, between two points of our code, and knows which of its stages issued the work.
#include "gpu/timeline.cuh"

#include <cuda_runtime_api.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#if __has_include(<cupti.h>)
#include <cupti.h>
#define MOE_HAVE_CUPTI 1
#endif

namespace moe::gpu {

namespace {

// The stage names of this thread's open TimelineStages, outermost first.
thread_local std::vector<const char*> t_stages;
std::atomic<bool> g_recording{false};

}  // namespace

#ifdef MOE_HAVE_CUPTI

namespace {

constexpr CUpti_ExternalCorrelationKind kStageKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
// External correlation first, so that it is on before the first API call it should tag.
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                         CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER,
                                         CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

struct Api {
  std::string error;  // empty: loaded
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityPushExternalCorrelationId) push = nullptr;
  decltype(&cuptiActivityPopExternalCorrelationId) pop = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

Api load_api() {
  Api a;
  std::vector<std::string> tried;
  void* lib = nullptr;
  if (const char* path = std::getenv("MOE_CUPTI_LIB"); path && *path) {
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      a.error = std::string("MOE_CUPTI_LIB='") + path + "' cannot be loaded: " + dlerror();
      return a;
    }
  } else {
    for (const char* name :
         {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13",
          "/usr/local/cuda/lib64/libcupti.so.13",
          "/usr/local/cuda/targets/x86_64-linux/lib/libcupti.so.13"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      tried.push_back(name);
    }
    if (!lib) {
      a.error =
          "CUPTI not found (tried libcupti.so.13 on the loader's path and under "
          "/usr/local/cuda; set MOE_CUPTI_LIB to its path)";
      return a;
    }
  }
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn && a.error.empty()) a.error = std::string("CUPTI lacks ") + name;
  };
  get(a.enable, "cuptiActivityEnable");
  get(a.disable, "cuptiActivityDisable");
  get(a.register_callbacks, "cuptiActivityRegisterCallbacks");
  get(a.flush_all, "cuptiActivityFlushAll");
  get(a.next_record, "cuptiActivityGetNextRecord");
  get(a.push, "cuptiActivityPushExternalCorrelationId");
  get(a.pop, "cuptiActivityPopExternalCorrelationId");
  get(a.result_string, "cuptiGetResultString");
  return a;  // the library stays loaded for the process: CUPTI keeps callbacks into it
}

const Api& api() {
  static const Api a = load_api();
  return a;
}

std::string result_text(CUptiResult r) {
  const char* s = nullptr;
  if (api().result_string && api().result_string(r, &s) == CUPTI_SUCCESS && s) return s;
  return "CUPTI error " + std::to_string(static_cast<int>(r));
}

// What a recording collects. The buffer callback runs on CUPTI's threads or inside a flush.
struct Collected {
  std::mutex mu;
  std::vector<TimelineEvent> events;
  std::vector<std::pair<uint32_t, uint32_t>> corr;  // per event: driver, runtime ids
  std::unordered_map<uint32_t, uint64_t> stage_of;  // correlation id -> stage id
  std::unordered_map<std::string, uint64_t> ids;    // stage path -> id (1-based)
  std::vector<std::string> paths;                   // id - 1 -> stage path
  bool registered = false;
};

Collected& collected() {
  static Collected c;
  return c;
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                           std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

const char* copy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy PtoP";
    default:
      return "memcpy";
  }
}

constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

// The fields every recorded kind has (device, stream, span); returns the correlation id.
template <class R>
uint32_t common_fields(const R* r, TimelineEvent& e) {
  e.device = r->deviceId;
  e.stream = r->streamId;
  e.start_ns = r->start;
  e.end_ns = r->end;
  return r->correlationId;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Collected& c = collected();
  std::lock_guard<std::mutex> lock(c.mu);
  CUpti_Activity* rec = nullptr;
  while (buffer && api().next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    TimelineEvent e;
    uint32_t corr = 0, runtime_corr = 0;
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        // The fields read here sit at the same offsets in every record version CUPTI 13 emits.
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        e.kind = "kernel";
        e.name = demangle(k->name);
        corr = common_fields(k, e);
        e.grid[0] = k->gridX, e.grid[1] = k->gridY, e.grid[2] = k->gridZ;
        e.block[0] = k->blockX, e.block[1] = k->blockY, e.block[2] = k->blockZ;
        e.registers = k->registersPerThread;
        e.shared_bytes = static_cast<uint32_t>(k->staticSharedMemory + k->dynamicSharedMemory);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        e.kind = "memcpy";
        e.name = copy_kind(m->copyKind);
        e.bytes = m->bytes;
        corr = common_fields(m, e);
        runtime_corr = m->runtimeCorrelationId;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        e.kind = "memset";
        e.name = "memset";
        e.bytes = m->bytes;
        corr = common_fields(m, e);
        break;
      }
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        const auto* x = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
        if (x->externalKind == kStageKind) c.stage_of[x->correlationId] = x->externalId;
        continue;
      }
      default:
        continue;
    }
    c.events.push_back(std::move(e));
    c.corr.emplace_back(corr, runtime_corr);
  }
  std::free(buffer);
}

void disable_all(size_t n) {
  for (size_t i = n; i-- > 0;) api().disable(kKinds[i]);
}

}  // namespace

std::string timeline_unavailable() {
  return api().error;
}

TimelineStage::TimelineStage(const char* name) {
  t_stages.push_back(name);
  if (!g_recording.load(std::memory_order_relaxed)) return;
  std::string path;
  for (const char* s : t_stages) {
    if (!path.empty()) path += '/';
    path += s;
  }
  uint64_t id = 0;
  {
    Collected& c = collected();
    std::lock_guard<std::mutex> lock(c.mu);
    auto [it, added] = c.ids.emplace(path, c.paths.size() + 1);
    if (added) c.paths.push_back(path);
    id = it->second;
  }
  pushed_ = api().push(kStageKind, id) == CUPTI_SUCCESS;
}

TimelineStage::~TimelineStage() {
  if (pushed_) {
    uint64_t last = 0;
    api().pop(kStageKind, &last);
  }
  t_stages.pop_back();
}

TimelineRecording::TimelineRecording() {
  const Api& a = api();
  if (!a.error.empty()) throw std::runtime_error("timeline: " + a.error);
  bool idle = false;
  if (!g_recording.compare_exchange_strong(idle, true)) {
    throw std::runtime_error("timeline: a recording is already running");
  }
  Collected& c = collected();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.events.clear();
    c.corr.clear();
    c.stage_of.clear();
  }
  auto fail = [&](const std::string& what, CUptiResult r, size_t enabled) {
    disable_all(enabled);
    g_recording = false;
    throw std::runtime_error("timeline: " + what + ": " + result_text(r) +
                             " (another profiler, e.g. ncu or nsys, may hold CUPTI)");
  };
  if (!c.registered) {
    const CUptiResult r = a.register_callbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) fail("cuptiActivityRegisterCallbacks", r, 0);
    c.registered = true;
  }
  for (size_t i = 0; i < std::size(kKinds); ++i) {
    const CUptiResult r = a.enable(kKinds[i]);
    if (r != CUPTI_SUCCESS) {
      fail("cuptiActivityEnable(kind " + std::to_string(static_cast<int>(kKinds[i])) + ")", r, i);
    }
  }
  running_ = true;
}

std::vector<TimelineEvent> TimelineRecording::stop() {
  if (!running_) return {};
  running_ = false;
  const cudaError_t sync = cudaDeviceSynchronize();
  api().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  disable_all(std::size(kKinds));
  api().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  g_recording = false;
  Collected& c = collected();
  std::vector<TimelineEvent> out;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    for (size_t i = 0; i < c.events.size(); ++i) {
      auto it = c.stage_of.find(c.corr[i].first);
      if (it == c.stage_of.end() && c.corr[i].second) it = c.stage_of.find(c.corr[i].second);
      if (it != c.stage_of.end() && it->second >= 1 && it->second <= c.paths.size()) {
        c.events[i].stage = c.paths[it->second - 1];
      }
    }
    out = std::move(c.events);
    c.events.clear();
    c.corr.clear();
    c.stage_of.clear();
  }
  if (sync != cudaSuccess) {
    throw std::runtime_error(std::string("timeline: cudaDeviceSynchronize: ") +
                             cudaGetErrorString(sync));
  }
  std::stable_sort(out.begin(), out.end(), [](const TimelineEvent& x, const TimelineEvent& y) {
    return x.start_ns < y.start_ns;
  });
  return out;
}

#else  // no cupti.h at build time: stages are bookkeeping only, a recording cannot start

std::string timeline_unavailable() {
  return "built without cupti.h (the CUDA toolkit's CUPTI)";
}

TimelineStage::TimelineStage(const char* name) {
  t_stages.push_back(name);
}
TimelineStage::~TimelineStage() {
  t_stages.pop_back();
}

TimelineRecording::TimelineRecording() {
  throw std::runtime_error("timeline: " + timeline_unavailable());
}

std::vector<TimelineEvent> TimelineRecording::stop() {
  return {};
}

#endif

TimelineRecording::~TimelineRecording() {
  if (!running_) return;
  try {
    stop();
  } catch (...) {
  }
}

}  // namespace moe::gpu

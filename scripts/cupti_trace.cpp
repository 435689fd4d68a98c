// A timeline recorder for machines without Nsight Systems (our GPU machine has ncu only): an
// LD_PRELOAD library that records, through CUPTI's activity API, every kernel, memcpy, memset and
// CUDA runtime/driver call of the process, and writes them as CSV at exit. Unlike ncu it does not
// serialise kernels, so the gaps between them (host synchronisations, allocations) are what the
// program really has. Unlike CUDA_INJECTION64_PATH tools it leaves the buffer cache on
// (gpu/runtime.cu turns it off under an injected tool).
//
// Build: g++ -O2 -shared -fPIC -std=c++17 scripts/cupti_trace.cpp -I$CUDA/include
//          -L$CUDA/lib64 -lcupti -o /tmp/libcupti_trace.so
// Use:   MOE_TRACE_CSV=/tmp/t.csv LD_PRELOAD=/tmp/libcupti_trace.so moe-harness bench ...
// Rows: kind,start_ns,end_ns,stream,name (kind: kernel, memcpy, memset, runtime, driver).
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr size_t kBufBytes = size_t{8} << 20;
std::FILE* g_out = nullptr;
std::mutex g_mu;

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, kBufBytes));
  *size = kBufBytes;
  *max_records = 0;
}

const char* memcpy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy_HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy_DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy_DtoD";
    default:
      return "memcpy_other";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mu);
  CUpti_Activity* rec = nullptr;
  while (g_out && cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        std::string name = k->name ? k->name : "?";
        for (char& c : name) c = c == ',' ? ';' : c;
        std::fprintf(g_out, "kernel,%llu,%llu,%u,%s\n", (unsigned long long)k->start,
                     (unsigned long long)k->end, k->streamId, name.c_str());
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        std::fprintf(g_out, "memcpy,%llu,%llu,%u,%s %llu B\n", (unsigned long long)m->start,
                     (unsigned long long)m->end, m->streamId, memcpy_kind(m->copyKind),
                     (unsigned long long)m->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        std::fprintf(g_out, "memset,%llu,%llu,%u,memset %llu B\n", (unsigned long long)m->start,
                     (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        const CUpti_CallbackDomain dom = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME
                                             ? CUPTI_CB_DOMAIN_RUNTIME_API
                                             : CUPTI_CB_DOMAIN_DRIVER_API;
        cuptiGetCallbackName(dom, a->cbid, &name);
        std::fprintf(g_out, "%s,%llu,%llu,0,%s\n",
                     rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? "runtime" : "driver",
                     (unsigned long long)a->start, (unsigned long long)a->end, name ? name : "?");
        break;
      }
      default:
        break;
    }
  }
  std::free(buf);
}

struct Tracer {
  Tracer() {
    const char* path = std::getenv("MOE_TRACE_CSV");
    if (!path || !*path) return;
    g_out = std::fopen(path, "w");
    if (!g_out) {
      std::fprintf(stderr, "cupti_trace: cannot write %s\n", path);
      return;
    }
    std::fprintf(g_out, "kind,start_ns,end_ns,stream,name\n");
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    for (CUpti_ActivityKind k :
         {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
          CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER}) {
      if (cuptiActivityEnable(k) != CUPTI_SUCCESS) {
        std::fprintf(stderr, "cupti_trace: cannot enable activity kind %d\n", static_cast<int>(k));
      }
    }
  }
  ~Tracer() {
    if (!g_out) return;
    cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(g_mu);
    std::fclose(g_out);
    g_out = nullptr;
  }
};

Tracer g_tracer;

}  // namespace

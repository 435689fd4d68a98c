// What `moe-harness bench --timeline FILE` makes of a recorded call (gpu/timeline.cuh): a summary
// printed under the case's rows and kept in --json (span, GPU busy and idle time, the time per
// stage), and the events themselves as a Chrome trace (FILE; open it in Perfetto or
// chrome://tracing: one process per recorded call, one thread per stream, times from the call's
// first event). Host code only: tested without a GPU.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "gpu/timeline.cuh"

namespace moe::tools {

struct StageTime {
  std::string stage;            // "" for work issued outside any stage
  int kernels = 0, copies = 0;  // copies: memcpys and memsets
  double busy_us = 0;           // sum of its events' durations
  double active_us = 0;  // time some event of it ran (the union: overlapping streams count once)
  double first_us = 0, last_us = 0;                 // its first start, last end (from t0)
  std::vector<std::pair<std::string, double>> top;  // its 3 longest kernels by total us
};

// An idle interval and the work on either side of it ("kernel [stage]"): what the GPU waited
// between, e.g. a host synchronisation inside a stage, or host work between two stages.
struct TimelineGap {
  double us = 0;
  std::string after, before;
};

struct TimelineSummary {
  int events = 0, kernels = 0, copies = 0;
  double span_us = 0;  // the first event's start to the last one's end
  double busy_us = 0;  // time some event ran, on any stream (the union of their intervals)
  double idle_us = 0;  // span - busy: the GPU ran nothing (launch gaps, host waits)
  int gaps = 0;        // idle intervals
  double largest_gap_us = 0;
  std::vector<TimelineGap> largest_gaps;  // the 3 longest, longest first
  // Stages in the order of their first event. A stage's busy_us sums its events' durations, so
  // work that overlaps on two streams counts twice there; its active_us counts it once.
  std::vector<StageTime> stages;
};

TimelineSummary summarize_timeline(const std::vector<gpu::TimelineEvent>& events);

// "void moe::gpu::(anonymous namespace)::act_fwd_vec_kernel<__nv_bfloat16>(const ...)" ->
// "act_fwd_vec_kernel": the function's own name, without scope, template arguments or parameters.
std::string short_kernel_name(const std::string& demangled);

nlohmann::json timeline_json(const TimelineSummary& s);

// The summary as indented lines for bench's output (label: "moe_block deepseek_like fwd+bwd").
std::string timeline_text(const std::string& label, const TimelineSummary& s, double median_us);

// Appends one recorded call to a Chrome trace's "traceEvents" array as process `pid` named
// `label`: a complete event ("ph": "X") per kernel, copy or memset with its stage, full name and
// launch shape in "args", times in microseconds from the call's first event.
void append_chrome_trace(nlohmann::json& trace_events, int pid, const std::string& label,
                         const std::vector<gpu::TimelineEvent>& events);

}  // namespace moe::tools

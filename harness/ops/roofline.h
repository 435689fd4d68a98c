// Roofline arithmetic of `moe-harness bench` (pure; tests/cpu/test_roofline.cpp pins it).
//
// The roofline time of work of `flops` FLOPs moving at least `bytes` bytes (read + written) is
//   max(flops / rate, bytes / bandwidth)
// with rate the dense cuBLAS GEMM rate (TFLOP/s) and bandwidth the device-to-device copy bandwidth
// (GB/s, read + write) measured in the same bench run. A composite op with a per-stage breakdown
// (Cost::stages) runs its stages one after another, so its roofline is the sum of the stages'
// rooflines, each stage bound by its own flops or bytes; that sum is at least the single max over
// the totals. % of roofline = 100 * roofline / measured median: 100% is at the roofline.
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/ops/registry.h"

namespace moe::ops {

struct Roofline {
  double us = 0;            // roofline time in microseconds
  bool flop_bound = false;  // flops / rate > bytes / bandwidth (a tie counts as bytes)
  const char* bound() const { return flop_bound ? "flops" : "bytes"; }
};

namespace roofline_detail {
inline void require_positive(const char* name, double v) {
  if (!(v > 0) || !std::isfinite(v)) {
    throw std::invalid_argument(std::string("roofline: ") + name +
                                " must be a finite value > 0 (got " + std::to_string(v) + ")");
  }
}
inline void require_nonnegative(const char* name, double v) {
  if (!(v >= 0) || !std::isfinite(v)) {
    throw std::invalid_argument(std::string("roofline: ") + name +
                                " must be a finite value >= 0 (got " + std::to_string(v) + ")");
  }
}
}  // namespace roofline_detail

// max(flops / (tflops * 1e12), bytes / (gbps * 1e9)) in microseconds, and which term won.
// Throws std::invalid_argument naming the parameter when tflops or gbps is not > 0, or flops or
// bytes is negative (or any of them is not finite).
inline Roofline roofline(double flops, double bytes, double tflops, double gbps) {
  roofline_detail::require_nonnegative("flops", flops);
  roofline_detail::require_nonnegative("bytes", bytes);
  roofline_detail::require_positive("tflops", tflops);
  roofline_detail::require_positive("gbps", gbps);
  const double flop_us = flops / (tflops * 1e12) * 1e6;
  const double byte_us = bytes / (gbps * 1e9) * 1e6;
  return {std::max(flop_us, byte_us), flop_us > byte_us};
}

inline double roofline_us(double flops, double bytes, double tflops, double gbps) {
  return roofline(flops, bytes, tflops, gbps).us;
}

// The work of one bench row: the forward alone, or forward + backward (fwd+bwd rows).
inline double row_flops(const StageCost& s, bool with_bwd) {
  return with_bwd ? s.fwd_flops + s.bwd_flops : s.fwd_flops;
}
inline double row_bytes(const StageCost& s, bool with_bwd) {
  return with_bwd ? s.fwd_bytes + s.bwd_bytes : s.fwd_bytes;
}

struct StageRoofline {
  std::string name;
  Roofline roof;
};

// Each stage's roofline for a fwd (with_bwd = false) or fwd+bwd row: the stage's fwd (+ bwd)
// flops and bytes at the row's rate (the dense fwd, or fwd + dgrad + wgrad, rate) and bandwidth.
inline std::vector<StageRoofline> stage_rooflines(const std::vector<StageCost>& stages,
                                                  bool with_bwd, double tflops, double gbps) {
  std::vector<StageRoofline> v;
  v.reserve(stages.size());
  for (const StageCost& s : stages) {
    v.push_back({s.name, roofline(row_flops(s, with_bwd), row_bytes(s, with_bwd), tflops, gbps)});
  }
  return v;
}

// The sum of the stages' roofline times (stages run one after another).
inline double stage_sum_us(const std::vector<StageRoofline>& stages) {
  double us = 0;
  for (const StageRoofline& s : stages) us += s.roof.us;
  return us;
}

// 100 * roof_us / median_us: 100% at the roofline, below it slower. Throws std::invalid_argument
// naming median_us when it is not > 0, roof_us when it is negative.
inline double pct_of_roofline(double roof_us, double median_us) {
  roofline_detail::require_nonnegative("roof_us", roof_us);
  roofline_detail::require_positive("median_us", median_us);
  return 100.0 * roof_us / median_us;
}

}  // namespace moe::ops

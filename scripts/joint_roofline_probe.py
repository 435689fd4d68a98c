#!/usr/bin/env python3
"""How close to the roofline the roofline's own yardsticks get when they run at the same time
(issue #20: the DeepSeek-like grouped GEMM, whose FLOP time and byte time are about equal).

`bench`'s roofline of a GEMM-like row is max(FLOPs / dense cuBLAS rate, fewest bytes / copy
bandwidth): it assumes the FLOPs and the DRAM traffic overlap for free. This script asks the GPU
to do exactly that work with the yardstick kernels themselves, at once, and times it:
  - the FLOPs: the dense cuBLAS GEMM of equal FLOPs (torch.mm, bf16), which also moves its own x
    and out (the grouped GEMM's non-weight bytes);
  - the weight bytes: every expert weight streamed once from DRAM, by a read-only kernel
    (16-byte loads, grid of B blocks) or, for a direction that writes them (wgrad), a write-only
    kernel; also by cudaMemcpy of half the bytes (read + write counted, as the copy bandwidth is).
The two run on two streams, forked and joined on a third; the makespan is the median of --reps.
Each stream grid and launch order is tried and the best makespan is kept, so the figure is the
most favourable overlap found. roofline / makespan is then the share of the roofline that the
FLOP yardstick and the byte yardstick reach together, doing the grouped GEMM's work: a grouped
GEMM at a higher share would have to beat the two kernels the roofline is made of.

Directions: fwd (x . w_g), and fwd+bwd (fwd, dgrad ct . w_g^T, wgrad x^T . ct: three dense
products; weights read twice and the weight gradient written once).
Needs torch and cupy with CUDA. Exit status 77 without them.
"""
import argparse
import statistics
import sys

try:
    import cupy as cp
    import torch
except ImportError as e:
    print(f"joint_roofline_probe: {e}", file=sys.stderr)
    sys.exit(77)

KERNELS = r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ src, long long n,
                                       unsigned* __restrict__ sink) {
  unsigned x = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads; the data never has this value
}
extern "C" __global__ void write_stream(uint4* __restrict__ dst, long long n) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    __stcs(dst + i, z);
}
"""


def median_ms(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


class Streams:
    """Byte streams over one buffer: read or write `nbytes` with a kernel of `blocks` blocks."""

    def __init__(self, nbytes):
        mod = cp.RawModule(code=KERNELS)
        self.read_k, self.write_k = mod.get_function("read_stream"), mod.get_function("write_stream")
        self.n = nbytes // 16
        self.buf = torch.full((self.n * 4,), 0x01010101, dtype=torch.int32, device="cuda")
        self.sink = torch.zeros(4, dtype=torch.int32, device="cuda")

    def run(self, kind, blocks, stream):
        with cp.cuda.ExternalStream(stream.cuda_stream):
            if kind == "read":
                self.read_k((blocks,), (512,), (self.buf.data_ptr(), cp.int64(self.n),
                                                 self.sink.data_ptr()))
            else:
                self.write_k((blocks,), (512,), (self.buf.data_ptr(), cp.int64(self.n)))


def joint_ms(gemms, byte_ops, order, reps):
    """Makespan of the dense products on one stream and the byte ops on another."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def step():
        fork = torch.cuda.Event()
        fork.record(main)
        s1.wait_event(fork)
        s2.wait_event(fork)
        first, second = ((s1, gemms), (s2, byte_ops)) if order == "gemm_first" else \
            ((s2, byte_ops), (s1, gemms))
        for s, ops in (first, second):
            with torch.cuda.stream(s):
                for op in ops:
                    op(s)
        main.wait_stream(s1)
        main.wait_stream(s2)

    return median_ms(step, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("joint_roofline_probe: no CUDA device", file=sys.stderr)
        return 77
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}")
    M, K, N, G = 65536, 7168, 2048, 256
    wbytes = 2 * G * K * N  # every expert weight once (bf16)
    x = torch.rand(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.rand(K, N, device=dev, dtype=torch.bfloat16)
    ct = torch.rand(M, N, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    gx = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
    gw = torch.empty(K, N, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * M * K * N
    dense = {  # the three products of equal FLOPs, as bench's dense rates time them
        "fwd": lambda s: torch.mm(x, w, out=out),
        "dgrad": lambda s: torch.mm(ct, w.t(), out=gx),
        "wgrad": lambda s: torch.mm(x.t(), ct, out=gw),
    }
    t_dense = {k: median_ms(lambda f=f: f(None), a.reps) for k, f in dense.items()}
    # The copy bandwidth as bench measures it: cudaMemcpy D2D of 1 GiB, read + write counted.
    c_src = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16).fill_(1.0)
    c_dst = torch.empty_like(c_src)
    copy_gbps = 2 * (1 << 30) / median_ms(lambda: c_dst.copy_(c_src), a.reps) / 1e6
    del c_src, c_dst
    st = Streams(wbytes)
    half = st.buf.view(torch.int16)[: wbytes // 4]  # cudaMemcpy of wbytes / 2: wbytes moved
    half_dst = torch.empty_like(half)
    grids = sorted({sms, 2 * sms, 4 * sms, 8 * sms, sms // 4, sms // 2})
    solo = {}
    for kind in ("read", "write"):
        best = min((median_ms(lambda g=g: st.run(kind, g, torch.cuda.current_stream()), a.reps), g)
                   for g in grids)
        solo[kind] = best
        print(f"solo {kind:5s} {wbytes / 1e9:.2f} GB: {best[0]:.3f} ms "
              f"({wbytes / best[0] / 1e6:.0f} GB/s, grid {best[1]})")
    t_memcpy = median_ms(lambda: half_dst.copy_(half), a.reps)
    print(f"solo memcpy {wbytes / 2e9:.2f} GB ({wbytes / 1e9:.2f} GB moved): {t_memcpy:.3f} ms "
          f"({wbytes / t_memcpy / 1e6:.0f} GB/s); copy bandwidth (1 GiB): {copy_gbps:.0f} GB/s")
    for k, t in t_dense.items():
        print(f"solo dense {k:5s}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)")

    dirs = {
        "fwd": (["fwd"], ["read"]),
        "fwd+bwd": (["fwd", "dgrad", "wgrad"], ["read", "read", "write"]),
    }
    for d, (prods, bytes_ops) in dirs.items():
        f_ms = sum(t_dense[p] for p in prods)
        # bench's cost model (harness/ops/grouped_gemm.cpp): each product moves the weights (or
        # their gradient) once and its two row operands once.
        b = len(prods) * (wbytes + 2 * (M * K + M * N))
        b_ms = b / copy_gbps / 1e6
        roof = max(f_ms, b_ms)
        print(f"\n{d}: roofline max({f_ms:.3f} ms of dense FLOPs, {b / 1e9:.2f} GB / "
              f"{copy_gbps:.0f} GB/s = {b_ms:.3f} ms) = {roof:.3f} ms; 88% needs "
              f"{roof / 0.88:.3f} ms, 85% {roof / 0.85:.3f}, 80% {roof / 0.80:.3f}")
        gemms = [dense[p] for p in prods]
        results = []
        for grid in grids:
            ops = [lambda s, k=k, g=grid: st.run(k, g, s) for k in bytes_ops]
            for order in ("gemm_first", "bytes_first"):
                results.append((joint_ms(gemms, ops, order, a.reps), f"kernels grid {grid}",
                                order))
        if all(k == "read" for k in bytes_ops):
            ops = [lambda s: half_dst.copy_(half) for _ in bytes_ops]
            for order in ("gemm_first", "bytes_first"):
                results.append((joint_ms(gemms, ops, order, a.reps), "cudaMemcpy", order))
        results.sort()
        for t, how, order in results[:4]:
            print(f"  joint {t:.3f} ms = {100 * roof / t:.1f}% of roofline  ({how}, {order})")
        t, how, order = results[0]
        print(f"{d}: best joint makespan {t:.3f} ms -> the yardsticks together reach "
              f"{100 * roof / t:.1f}% of the roofline ({how}, {order}); serial sum "
              f"{f_ms + sum(solo[k][0] for k in bytes_ops):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

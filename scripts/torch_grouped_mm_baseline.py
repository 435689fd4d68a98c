#!/usr/bin/env python3
"""Times torch._grouped_mm and a dense torch.mm of equal FLOPs on this GPU (bf16), at the grouped
GEMM benchmark shapes of `moe-harness bench` / GemmBench, so our figures can be set against the
issue's PyTorch reference numbers measured on the same device in the same session.

Group sizes follow harness/ops/perm_family.cpp's regimes: uniform (each row picks a group
uniformly) and skewed (weight 1/(g+1)^2). Needs torch with CUDA; prints one line per case.

Beside each uniform case, torch.bmm (cuBLAS strided-batched) on the same rows in equal groups
(`bench`'s batched yardstick): forward x[G, m, K] . w[G, K, N], dgrad g . w^T, wgrad x^T . g, in
our layout. `--profile` runs each of those three once between cudaProfilerStart and Stop, for
`ncu --profile-from-start off` to name cuBLAS's kernels and their tiles.
"""
import sys

import torch

CASES = [  # name, rows, K, N, groups
    ("mixtral", 32768, 4096, 14336, 8),
    ("deepseek", 65536, 7168, 2048, 256),
]


def sizes(rows, groups, regime, gen):
    if regime == "uniform":
        w = torch.ones(groups, dtype=torch.float64)
    else:
        w = 1.0 / (torch.arange(groups, dtype=torch.float64) + 1) ** 2
    picks = torch.multinomial(w, rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=groups)


def time_ms(fn, reps=10, warm=3):
    for _ in range(warm):
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
    ts.sort()
    return ts[len(ts) // 2]


def bmm_rows(name, rows, K, N, G, dev, profile):
    """torch.bmm forward, dgrad and wgrad on G equal groups of rows / G rows."""
    m = rows // G
    x = torch.randn(G, m, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device=dev, dtype=torch.bfloat16) * 0.02
    g = torch.randn(G, m, N, device=dev, dtype=torch.bfloat16)
    ops = {
        "fwd": lambda: torch.bmm(x, w),
        "dgrad": lambda: torch.bmm(g, w.transpose(1, 2)),
        "wgrad": lambda: torch.bmm(x.transpose(1, 2), g),
    }
    if profile:
        for f in ops.values():
            f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for f in ops.values():
            f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    ts = {k: time_ms(f) for k, f in ops.items()}
    flops = 2.0 * rows * K * N
    print(f"{name}_uniform: bmm of {G} x [{m} x {K}] . [{K} x {N}]: " +
          ", ".join(f"{k} {v:.3f} ms {flops / v / 1e9:.0f} TFLOP/s" for k, v in ts.items()) +
          f", fwd+dgrad+wgrad {sum(ts.values()):.3f} ms")
    del x, w, g


def main():
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    profile = "--profile" in sys.argv[1:]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    gen = torch.Generator().manual_seed(20261122)
    dev = "cuda"
    for name, rows, K, N, G in CASES:
        x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
        # [G, N, K] contiguous, passed transposed: the column-major B the grouped kernel wants.
        w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) * 0.02
        flops = 2.0 * rows * K * N
        dense_a = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
        dense_b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
        dense = flops / time_ms(lambda: torch.mm(dense_a, dense_b)) / 1e9
        bmm_rows(name, rows, K, N, G, dev, profile)
        if profile:
            continue
        for regime in ("uniform", "skewed"):
            s = sizes(rows, G, regime, gen)
            offs = torch.cumsum(s, 0).to(device=dev, dtype=torch.int32)
            try:
                ms = time_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
            except Exception as e:  # an older torch or an unsupported layout
                print(f"{name}_{regime}: torch._grouped_mm failed: {e}")
                continue
            t = flops / ms / 1e9
            print(f"{name}_{regime}: grouped_mm {ms:.3f} ms {t:.0f} TFLOP/s, dense mm {dense:.0f} "
                  f"TFLOP/s ({100 * t / dense:.0f}%), largest group {int(s.max())}")
        del x, w, dense_a, dense_b
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

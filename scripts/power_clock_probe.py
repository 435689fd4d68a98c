#!/usr/bin/env python3
"""What the GPU sustains when the tensor cores and DRAM are busy at once (issue #20's roofline
argument for the DeepSeek-like grouped GEMM, which needs both near their peaks together).

Runs each workload in a loop for --seconds on the current CUDA device while nvidia-smi samples the
SM clock and the board power every 50 ms, and prints per workload the achieved rate and the
median SM clock and power over the middle of the run:
  dense     torch.mm, bf16, [65536, 7168] x [7168, 2048] (the grouped forward's FLOPs)
  copy      dst.copy_(src), 2 x 2 GiB bf16 (read + write counted)
  grouped   torch._grouped_mm over 256 groups of ~256 rows (uniform sizes), same FLOPs as dense;
            its fewest bytes: every expert weight once, x and out once (8.72 GB)
  both      dense on one stream while copy runs on another, each stream timed by its own events
Needs torch with CUDA and nvidia-smi. Exit status 77 without them.
"""
import argparse
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    print("power_clock_probe: no torch", file=sys.stderr)
    sys.exit(77)


def sampler():
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-i", str(torch.cuda.current_device()), "-lms", "50"],
        stdout=subprocess.PIPE, text=True)


def stop_sampler(smi):
    """Stops nvidia-smi; returns the median SM clock and power over the middle half of its
    samples and their count (nan, nan, 0 without samples)."""
    smi.terminate()
    out, _ = smi.communicate()
    rows = []
    for line in out.strip().splitlines():
        try:
            c, p = (float(v) for v in line.split(","))
            rows.append((c, p))
        except ValueError:  # "N/A" or a partial line
            pass
    mid = rows[len(rows) // 4: max(len(rows) // 4 + 1, 3 * len(rows) // 4)]
    if not mid:
        return float("nan"), float("nan"), 0
    return statistics.median(r[0] for r in mid), statistics.median(r[1] for r in mid), len(mid)


def run(name, seconds, step, counters):
    """Calls step() until `seconds` pass and prints its rates, clock and power; returns the time
    of one call."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    smi = sampler()
    time.sleep(0.2)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    clock, power, samples = stop_sampler(smi)
    rates = ", ".join(f"{k} {v * n / dt / u:.0f} {unit}" for k, (v, u, unit) in counters.items())
    print(f"{name:8s} {n:5d} calls in {dt:5.2f} s: {rates}; SM clock {clock:.0f} MHz, "
          f"power {power:.0f} W (median of {samples} samples)", flush=True)
    return dt / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("power_clock_probe: no CUDA device", file=sys.stderr)
        return 77
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    M, K, N, G = 65536, 7168, 2048, 256
    x = torch.rand(M, K, device=dev, dtype=torch.bfloat16)
    wd = torch.rand(K, N, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * M * K * N
    t_dense = run("dense", a.seconds, lambda: torch.mm(x, wd), {"rate": (flops, 1e12, "TFLOP/s")})
    n_copy = 1 << 30  # bf16 elements: 2 GiB a buffer
    src = torch.empty(n_copy, device=dev, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    cbytes = 2.0 * src.numel() * src.element_size()
    t_copy = run("copy", a.seconds, lambda: dst.copy_(src), {"rate": (cbytes, 1e9, "GB/s")})
    gen = torch.Generator().manual_seed(7)
    picks = torch.randint(0, G, (M,), generator=gen)
    sizes = torch.bincount(picks, minlength=G)
    offs = torch.cumsum(sizes, 0).to(device=dev, dtype=torch.int32)
    w = torch.rand(G, K, N, device=dev, dtype=torch.bfloat16)
    gbytes = 2.0 * (G * K * N + M * K + M * N)
    run("grouped", a.seconds, lambda: torch._grouped_mm(x, w, offs=offs),
        {"rate": (flops, 1e12, "TFLOP/s"), "bytes": (gbytes, 1e9, "GB/s")})
    del w
    # Both at once: each stream gets as many calls as fill --seconds alone, timed by its own
    # events, so each rate is over that stream's span (they overlap for the shorter one).
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    n1, n2 = max(1, int(a.seconds / t_dense)), max(1, int(a.seconds / t_copy))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    smi = sampler()
    time.sleep(0.2)
    with torch.cuda.stream(s1):
        ev[0].record()
        for _ in range(n1):
            torch.mm(x, wd)
        ev[1].record()
    with torch.cuda.stream(s2):
        ev[2].record()
        for _ in range(n2):
            dst.copy_(src)
        ev[3].record()
    torch.cuda.synchronize()
    clock, power, samples = stop_sampler(smi)
    d_ms, c_ms = ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])
    print(f"both     dense {n1} calls in {d_ms / 1e3:.2f} s: {flops * n1 / d_ms / 1e9:.0f} "
          f"TFLOP/s; copy {n2} calls in {c_ms / 1e3:.2f} s: {cbytes * n2 / c_ms / 1e6:.0f} GB/s; "
          f"SM clock {clock:.0f} MHz, power {power:.0f} W (median of {samples} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

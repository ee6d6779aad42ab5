"""``python -m bench.nearest``: nearest-codeword search throughput (GFMA/s) on this CPU.

The search is ``argmin_k |c_k|^2 - 2 x.c_k`` over K codewords of g = 8 channels, for many
codebooks at once: what k-means' assignment step runs every Lloyd iteration (calibration)
and what the serving encoder runs for every prefilled token. Measured side by side, same
inputs, best of ``--reps``:

- ``torch matmul + argmin`` (fp32, chunked ``baddbmm`` then ``min``): k-means' assignment
  before the flat fit (:func:`calibrate.kmeans.assign_torch`, also its torch/CUDA backend);
- ``Numba lane kernel``: :func:`numba_kernels.cpu.search.nearest_sqdist`, the kernel the
  serving encoder and the CPU k-means both run (tokens across SIMD lanes, running minimum);
- the machine's reference peak: an fp32 4096^3 matmul (MKL through torch) in the same run.

One FMA = one multiply-add of a point coordinate with a codeword coordinate (T x B x K x g).

    python -m bench.nearest                 # k-means shape (24 codebooks x 32,768 points x 1,024)
    python -m bench.nearest --points 2048   # a prefill-sized batch
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(codebooks: int, points: int, K: int, reps: int, seed: int = 0) -> dict:
    from calibrate.kmeans import assign_torch
    from numba_kernels.cpu.search import nearest_sqdist

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(codebooks, points, 8, generator=gen)
    c = torch.randn(codebooks, K, 8, generator=gen)
    xt = x.transpose(0, 1).contiguous().numpy()
    cn = (c * c).sum(-1).numpy()
    fma = codebooks * points * K * 8
    t_torch = _best(lambda: assign_torch(x, c), reps)
    t_lane = _best(lambda: nearest_sqdist(xt, c.numpy(), cn), reps)
    codes_t, _ = assign_torch(x, c)
    codes_l, _ = nearest_sqdist(xt, c.numpy(), cn)
    agree = float((torch.from_numpy(codes_l).T.long() == codes_t).float().mean())
    a, b = torch.randn(4096, 4096, generator=gen), torch.randn(4096, 4096, generator=gen)
    t_mm = _best(lambda: a @ b, reps)
    peak = 4096 ** 3 / t_mm / 1e9
    rows = {"torch matmul + argmin": fma / t_torch / 1e9, "Numba lane kernel": fma / t_lane / 1e9}
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "codebooks": codebooks, "points": points, "K": K,
            "g": 8, "reps": reps, "sgemm_gfma_s": round(peak, 1),
            "gfma_s": {k: round(v, 2) for k, v in rows.items()},
            "share_of_sgemm": {k: round(v / peak, 3) for k, v in rows.items()},
            "lane_vs_torch": round(t_torch / t_lane, 2), "same_codes": round(agree, 6)}


def markdown(r: dict) -> str:
    lines = [f"nearest codeword, {r['codebooks']} codebooks x {r['points']:,} points x K={r['K']}, g=8; "
             f"{r['cpu']}, {r['threads']} threads; fp32 sgemm reference {r['sgemm_gfma_s']} GFMA/s", "",
             "| search | GFMA/s | share of sgemm |", "|---|---|---|"]
    for k, v in r["gfma_s"].items():
        lines.append(f"| {k} | {v} | {r['share_of_sgemm'][k]:.0%} |")
    lines.append(f"\nlane kernel / torch: {r['lane_vs_torch']}x faster; same codes on {r['same_codes']:.4%} of points")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nearest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codebooks", type=int, default=24, help="codebooks searched at once (24: one layer's keys)")
    ap.add_argument("--points", type=int, default=32768, help="points per codebook")
    ap.add_argument("--K", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="also write the result as JSON here")
    a = ap.parse_args(argv)
    from numba_kernels.cpu import set_threads

    set_threads()
    r = measure(a.codebooks, a.points, a.K, a.reps)
    print(markdown(r))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

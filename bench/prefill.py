"""Time to first token of the served prefill: TaSQ against bf16, measured in the same run.

    python -m bench.prefill [--lengths 1024 2048 4096] [--reps 5] [--chunked-prefill-size N]

Both servers (``sglang.launch_server``: bf16 on ``torch_native``, TaSQ with ``--tasq-config``;
radix cache off so every request prefills its whole prompt; ``--sleep-on-idle``) are up at
once, and the requests alternate between them: each is one ``/generate`` of a fixed random
prompt of L token ids with one output token, greedy, so its wall time is the prefill (+ one
sampling step and the HTTP round trip, the same for both). The median over ``--reps`` per
server and length, and the TaSQ / bf16 ratio, are printed and written to
``bench/results/prefill/<workload>/prefill.json`` (+ ``prefill.md``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from sglang_tasq.options import passive_omp

passive_omp()

from sglang_tasq.demo import _post, stop_server  # noqa: E402
from sglang_tasq.models import resolve_model  # noqa: E402

from .serving import DEFAULT_ARTIFACTS, start_server  # noqa: E402
from .serving_report import hardware  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "prefill"


def prompt_ids(n: int, vocab: int = 49152, seed: int = 0) -> list:
    """A fixed pseudo-random prompt of ``n`` token ids (ids 100.. to skip special tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed + n)
    return (torch.randint(100, vocab, (n,), generator=g)).tolist()


def ttft(base: str, ids: list) -> float:
    t = time.perf_counter()
    _post(base + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    return time.perf_counter() - t


def server_opts(a) -> SimpleNamespace:
    """The servers' options (:func:`bench.serving.server_cmd`): radix cache off, so every rep
    prefills its whole prompt; idle servers sleep (both are up at once)."""
    return SimpleNamespace(mem_fraction_static=a.mem_fraction_static, paired=True, tasq_config=a.tasq_config,
                           start_timeout=600, window_rows=4, disable_radix_cache=True)


def run(a) -> dict:
    model_dir = resolve_model("smollm2-135m")
    log_dir = a.out / "logs"
    opts = server_opts(a)
    servers, res = {}, {}
    try:
        for name in ("bf16", "tasq"):
            proc, base, state = start_server(name, model_dir, opts, None, log_dir)
            if proc is None:
                raise RuntimeError(f"{name} server failed: {state.get('reason')}")
            servers[name] = (proc, base)
        for n in a.lengths:
            ids = prompt_ids(n)
            for name, (_, base) in servers.items():  # warm-up (first forward of this length)
                ttft(base, ids)
            times = {name: [] for name in servers}
            for r in range(a.reps):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    times[name].append(ttft(servers[name][1], ids))
            med = {name: statistics.median(t) for name, t in times.items()}
            res[str(n)] = {"median_s": {k: round(v, 3) for k, v in med.items()},
                           "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                           "tasq_vs_bf16": round(med["tasq"] / med["bf16"], 2)}
            print(f"[prefill] {n} tokens: bf16 {med['bf16']:.2f} s, TaSQ {med['tasq']:.2f} s "
                  f"({med['tasq'] / med['bf16']:.2f}x)", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mem-fraction-static", type=float, default=0.05)
    ap.add_argument("--tasq-config", type=Path, default=next((p for p in DEFAULT_ARTIFACTS if p.is_file()), None))
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: keyed by the workload)")
    a = ap.parse_args(argv)
    if a.tasq_config is None:
        ap.error("no artifact: calibrate one (make calibrate) or pass --tasq-config")
    manifest = Path(a.tasq_config).read_bytes()
    work = {"model": "smollm2-135m", "lengths": a.lengths, "reps": a.reps, "mem_fraction_static": a.mem_fraction_static,
            "artifact_sha1": hashlib.sha1(manifest).hexdigest()[:12], "radix_cache": False, "output_tokens": 1}
    key = hashlib.sha1(json.dumps(work, sort_keys=True).encode()).hexdigest()[:8]
    a.out = a.out or RESULTS / f"smollm2-135m_{'-'.join(map(str, a.lengths))}_{key}"
    a.out.mkdir(parents=True, exist_ok=True)
    res = run(a)
    hw = hardware()
    out = {"workload": work, "hardware": hw, "results": res}
    (a.out / "prefill.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Served prefill TTFT (SmolLM2-135M, {hw['cpu']}, {hw['cores']} cores)", "",
             "| prompt tokens | bf16 (torch_native) | TaSQ | TaSQ / bf16 |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['median_s']['bf16']:.2f} s | {r['median_s']['tasq']:.2f} s | {r['tasq_vs_bf16']:.2f}x |"
              for n, r in res.items()]
    (a.out / "prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[prefill] run folder: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token of the served prefill: TaSQ against bf16, measured in the same run.

    python -m bench.prefill [--lengths 1024 2048 4096] [--reps 5] [--chunked-prefill-size N]

Both servers (``sglang.launch_server``: bf16 on ``torch_native``, TaSQ with ``--tasq-config``;
radix cache off so every request prefills its whole prompt; ``--sleep-on-idle``) are up at
once, and the requests alternate between them: each is one ``/generate`` of a fixed random
prompt of L token ids with one output token, greedy, so its wall time is the prefill (+ one
sampling step and the HTTP round trip, the same for both). The median over ``--reps`` per
server and length, and the TaSQ / bf16 ratio, are printed and written to
``bench/results/prefill/<workload>/prefill.json`` (+ ``prefill.md``).

The TaSQ server runs with ``SGLANG_TASQ_PROFILE`` (:mod:`sglang_tasq.srt.profile`), so each of
its timed requests also reports, from inside the server, the time of its forward and of the
backend's parts: the encode (``store``: un-rotate, tailor, nearest-codeword search, pack, write),
the codes read for the window rule (``codes``) and the attention. The encode's overhead is its
time over bf16's TTFT (the paper's "TTFT overhead of the encode": 10-14% on GPU).
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
from sglang_tasq.options import set_env  # noqa: E402
from sglang_tasq.srt import profile  # noqa: E402

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


def split(records: list) -> dict:
    """Sum of the extend forwards' profile records (one request's prefill: one record per
    chunk) -> {"forward": s, "store": s, "codes": s, "attention": s}."""
    out = {"forward": 0.0, "store": 0.0, "codes": 0.0, "attention": 0.0}
    for r in records:
        if r.get("mode") != "extend":
            continue
        out["forward"] += r["forward_s"]
        for k, v in r["parts_s"].items():
            out[k] = out.get(k, 0.0) + v
    return out


def run(a) -> dict:
    model_dir = resolve_model("smollm2-135m")
    log_dir = a.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    prof_path = log_dir / "tasq_profile.jsonl"
    prof_path.unlink(missing_ok=True)
    set_env(profile.ENV, str(prof_path))  # only the TaSQ backend reads it
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
            parts = []
            for r in range(a.reps):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    seen = len(profile.read(prof_path)) if name == "tasq" else 0  # only TaSQ writes it
                    times[name].append(ttft(servers[name][1], ids))
                    if name == "tasq":
                        parts.append(split(profile.read(prof_path)[seen:]))
            med = {name: statistics.median(t) for name, t in times.items()}
            part_med = {k: statistics.median(p[k] for p in parts) for k in parts[0]} if parts else {}
            res[str(n)] = {"median_s": {k: round(v, 3) for k, v in med.items()},
                           "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                           "tasq_vs_bf16": round(med["tasq"] / med["bf16"], 2),
                           "tasq_parts_median_s": {k: round(v, 3) for k, v in part_med.items()},
                           "encode_vs_bf16_ttft": round(part_med["store"] / med["bf16"], 3) if part_med else None}
            enc = (f"; encode {part_med['store']:.2f} s = {100 * part_med['store'] / med['bf16']:.1f}% of bf16's TTFT, "
                   f"codes {part_med['codes']:.2f} s, attention {part_med['attention']:.2f} s" if part_med else "")
            print(f"[prefill] {n} tokens: bf16 {med['bf16']:.2f} s, TaSQ {med['tasq']:.2f} s "
                  f"({med['tasq'] / med['bf16']:.2f}x){enc}", flush=True)
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
             "| prompt tokens | bf16 (torch_native) | TaSQ | TaSQ / bf16 | TaSQ encode (/ bf16 TTFT) "
             "| TaSQ codes read | TaSQ attention |", "|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        p = r["tasq_parts_median_s"]
        lines.append(f"| {n} | {r['median_s']['bf16']:.2f} s | {r['median_s']['tasq']:.2f} s | {r['tasq_vs_bf16']:.2f}x "
                     f"| {p['store']:.2f} s ({100 * r['encode_vs_bf16_ttft']:.1f}%) | {p['codes']:.2f} s "
                     f"| {p['attention']:.2f} s |")
    (a.out / "prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[prefill] run folder: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

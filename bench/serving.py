"""Serving benchmark: bf16, fp8 and TaSQ KV caches in the same KV memory budget, side by side.

``python -m bench.serving [--quick] [--tasq-config PATH] [--servers bf16 fp8 tasq] [--force]``
starts the servers one after another (``sglang.launch_server`` on 127.0.0.1, CPU recipe of
:mod:`sglang_tasq.demo`) and measures each with ``python -m sglang.benchmark.serving --backend
sglang --dataset-name random-ids`` (``random`` downloads ShareGPT) at every ``--concurrency``.

KV budget: on CPU SGLang sizes the pool from free RAM minus ``(1 - mem_fraction_static) x`` the
RAM free before loading, then ``max_total_num_tokens = budget // cell_size``
(``DefaultPoolConfigurator``, where the TaSQ plugin reports its true cell size and charges its
window rings as fixed bytes). Free RAM moves on a shared host, so ``--kv-budget-mib B`` fixes
B: every server gets the same ``--mem-fraction-static`` and ``--max-total-tokens (B - fixed) //
cell``; the tokens and KV bytes each server got are read back from it (``--kv-budget-mib 0``:
SGLang's own sizing). Radix cache off everywhere. Writes ``DIR/<server>.json`` (reused unless
``--force``), ``DIR/summary.json`` and ``DIR/summary.md``.

Noisy hosts: ``--rounds N`` repeats the servers one after another N times (best round kept);
``--paired`` instead keeps every server up (``--sleep-on-idle``) and measures them back to back
within each round, and the summary reports the per-round TaSQ/bf16 throughput ratios and
their median, the figure that survives a host whose speed drifts over minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from sglang_tasq.demo import _free_port, _get, stop_server, wait_ready
from sglang_tasq.srt.launch import model_config_dict
from sglang_tasq.models import fingerprint, resolve_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "serving"
SERVERS = ("bf16", "fp8", "tasq")
DEFAULT_ARTIFACTS = (ROOT / "artifacts/smollm2/tasq.json", ROOT / "artifacts/smollm2-fast/tasq.json")
# quick: in 96 MiB bf16 holds 4 requests of 1024 + 32 tokens, fp8 8; TaSQ's exact window store
# costs 13.3 MB per running request (SmolLM2), so 96 MiB holds the windows of 4 running requests
# (53 MB) and 24k tokens of codes (8 rows would need 106 MB, more than the budget)
PRESETS = {
    "quick": dict(input_len=1024, output_len=32, num_prompts=4, concurrency=[1, 4, 8], kv_budget_mib=96, window_rows=4),
    "full": dict(input_len=2048, output_len=128, num_prompts=32, concurrency=[1, 4, 16, 32], kv_budget_mib=512,
                 window_rows=32)}


def kv_cells(model_dir: Path, manifest: Path | None, window_rows: int) -> dict:
    """{server: (bytes per token slot, fixed bytes)}, the numbers SGLang's pool sizing uses."""
    fp = fingerprint(model_config_dict(str(model_dir)))
    bf16 = fp.num_kv_heads * 2 * fp.head_dim * fp.num_layers * 2
    cells = {"bf16": (bf16, 0), "fp8": (bf16 // 2, 0)}
    if manifest is not None:
        from sglang_tasq.artifact import load_artifact
        from sglang_tasq.srt.pool import bytes_per_token, window_bytes

        cfg = load_artifact(manifest).config
        from sglang_tasq.srt.plugin import SLOT_INDEX_BYTES

        cells["tasq"] = (bytes_per_token(cfg, fp.num_kv_heads, fp.head_dim, fp.num_layers) + SLOT_INDEX_BYTES,
                         window_bytes(cfg, fp.num_kv_heads, fp.head_dim, fp.num_layers, window_rows))
    return cells


def budget_tokens(budget_bytes: int, cell: int, fixed: int = 0) -> int:
    """Token slots a pool of ``cell`` bytes each gets from ``budget_bytes`` after ``fixed``."""
    return max(0, (budget_bytes - fixed) // cell)


def requests_that_fit(pool_tokens: int, input_len: int, output_len: int) -> int:
    """Requests whose whole sequence (prompt + output) is resident at once."""
    return pool_tokens // (input_len + output_len)


def server_cmd(name: str, model_dir: Path, port: int, a, max_tokens: int | None) -> list:
    """The ``sglang.launch_server`` command line of server ``name`` (bf16, fp8 or tasq)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "cpu",
           "--disable-cuda-graph", "--disable-radix-cache", "--host", "127.0.0.1", "--port", str(port),
           "--mem-fraction-static", str(a.mem_fraction_static)]
    cmd += ["--max-total-tokens", str(max_tokens)] if max_tokens else []
    cmd += ["--sleep-on-idle"] if getattr(a, "paired", False) else []
    if name == "bf16":
        return cmd + ["--attention-backend", "torch_native"]
    if name == "fp8":  # SGLang's CPU fp8 KV cache requires the intel_amx backend (and AMX)
        return cmd + ["--attention-backend", "intel_amx", "--kv-cache-dtype", "fp8_e4m3"]
    return cmd + ["--tasq-config", str(a.tasq_config)]


PEAK_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage")


def scan_peaks(loads: dict, peak: dict) -> dict:
    """Fold the largest :data:`PEAK_KEYS` values of a ``/v1/loads`` answer into ``peak``."""
    for load in loads.get("loads") or []:
        for k in PEAK_KEYS:
            if isinstance(load.get(k), (int, float)):
                peak[k] = max(peak.get(k, 0), load[k])
    return peak


def _poll_loads(base: str, peak: dict, stop: threading.Event, period: float = 0.5) -> None:
    while not stop.wait(period):
        with contextlib.suppress(OSError, ValueError):
            scan_peaks(_get(base + "/v1/loads", timeout=5), peak)


def bench_once(base: str, model_dir: Path, a, conc: int, out: Path) -> dict:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", base,
           "--model", str(model_dir), "--tokenizer", str(model_dir), "--dataset-name", "random-ids",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(max(a.num_prompts, conc)), "--max-concurrency", str(conc),
           "--seed", "1", "--disable-tqdm", "--output-file", str(out)]
    peak, stop = {}, threading.Event()
    poller = threading.Thread(target=_poll_loads, args=(base, peak, stop), daemon=True)
    poller.start()
    try:
        with open(out.with_suffix(".txt"), "w") as log:
            subprocess.run(cmd, check=True, timeout=a.bench_timeout, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    finally:
        stop.set()
        poller.join(timeout=10)
    res = json.loads(out.read_text().strip().splitlines()[-1])
    keep = ("completed", "duration", "output_throughput", "total_throughput", "request_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_e2e_latency_ms", "max_concurrent_requests")
    return {**{k: res.get(k) for k in keep}, "server_peak": peak}


def server_state(info: dict, loads: dict) -> dict:
    """Pool size, request cap and KV memory as the server reports them (/get_server_info, /v1/loads)."""
    states = (info.get("internal_states") or [{}])[0]
    load = (loads.get("loads") or [{}])[0]
    pick = lambda k: next((d[k] for d in (load, states, info) if d.get(k) is not None), None)  # noqa: E731
    return {"max_total_num_tokens": pick("max_total_num_tokens"), "max_running_requests": pick("max_running_requests"),
            **{k: (load.get("memory") or {}).get(k) for k in ("kv_cache_gb", "weight_gb")},
            **{k: info.get(k) for k in ("kv_cache_dtype", "attention_backend", "dtype")}}


def start_server(name: str, model_dir: Path, a, max_tokens: int | None, log_dir: Path):
    """Launch server ``name`` and wait until it answers -> (process, base URL, state) or
    (None, None, failure record)."""
    base = f"http://127.0.0.1:{(port := _free_port())}"
    cmd = server_cmd(name, model_dir, port, a, max_tokens)
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               SGLANG_TASQ_WINDOW_ROWS=str(a.window_rows))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[serving] {name}: {' '.join(cmd)}", flush=True)
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    try:
        wait_ready(base, proc, timeout=a.start_timeout)
    except (RuntimeError, TimeoutError) as e:
        stop_server(proc)
        tail = (log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        return None, None, {"status": "failed", "reason": f"{e}: {' | '.join(tail)}"[-600:], "cmd": cmd[2:]}
    return proc, base, {"status": "ok", "cmd": cmd[2:], "startup_s": round(time.time() - t0, 1),
                        **server_state(_get(base + "/get_server_info"), _get(base + "/v1/loads")), "runs": {}}


def measure(name: str, base: str, model_dir: Path, a, conc: int, log_dir: Path) -> dict:
    print(f"[serving] {name}: concurrency {conc}", flush=True)
    try:
        return bench_once(base, model_dir, a, conc, log_dir / f"{name}_c{conc}.jsonl")
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return {"error": str(e)[-300:]}


def run_server(name: str, model_dir: Path, a, max_tokens: int | None, log_dir: Path) -> dict:
    proc, base, res = start_server(name, model_dir, a, max_tokens, log_dir)
    if proc is None:
        return res
    try:
        for conc in a.concurrency:
            res["runs"][str(conc)] = measure(name, base, model_dir, a, conc, log_dir)
        return res
    finally:
        stop_server(proc)


def run_paired(names: list, model_dir: Path, a, caps: dict, log_dir: Path) -> dict:
    """All servers up at once (``--sleep-on-idle``: an idle one does not spin), then
    ``a.rounds`` rounds of back-to-back runs, server order reversed every other round, so
    that each round's figures of the servers are seconds apart: on a host whose speed drifts
    over minutes their ratio is far steadier than that of runs minutes apart. -> {name:
    result as :func:`merge_best` folds it, with ``rounds_tok_s`` in round order}."""
    procs, results = {}, {}
    try:
        for name in names:
            proc, base, res = start_server(name, model_dir, a, caps[name], log_dir)
            results[name] = dict(res, rounds_tok_s={})
            if proc is not None:
                procs[name] = (proc, base)
        for rnd in range(a.rounds):
            print(f"[serving] paired round {rnd + 1}/{a.rounds}", flush=True)
            order = [n for n in (names if rnd % 2 == 0 else names[::-1]) if n in procs]
            for conc in a.concurrency:
                for name in order:
                    run = measure(name, procs[name][1], model_dir, a, conc, log_dir)
                    results[name] = merge_best(results[name], {"status": "ok", "runs": {str(conc): run}})
        return results
    finally:
        for proc, _ in procs.values():
            stop_server(proc)


def paired_ratios(num: list, den: list) -> list:
    """Per-round ratios num[i] / den[i] of two servers' paired rounds (None where either failed)."""
    return [round(x / y, 3) if x and y else None for x, y in zip(num, den)]


def merge_best(prev: dict | None, new: dict) -> dict:
    """Fold one more round of a server into its result: per concurrency the run with the higher
    output throughput (on a shared host the best of interleaved rounds is the least disturbed
    one); every round's output tok/s stays under ``rounds_tok_s``."""
    if prev is None or prev.get("status") != "ok":
        out = dict(new)
        out["rounds_tok_s"] = {c: [v.get("output_throughput")] for c, v in new.get("runs", {}).items()}
        return out
    if new.get("status") != "ok":
        return prev
    out = dict(prev, runs=dict(prev["runs"]), rounds_tok_s={c: list(v) for c, v in prev["rounds_tok_s"].items()})
    for c, v in new.get("runs", {}).items():
        out["rounds_tok_s"].setdefault(c, []).append(v.get("output_throughput"))
        old = out["runs"].get(c)
        if "error" not in v and (old is None or "error" in old
                                 or (v.get("output_throughput") or 0) > (old.get("output_throughput") or 0)):
            out["runs"][c] = v
    return out


def hardware() -> dict:
    cpuinfo, meminfo = Path("/proc/cpuinfo").read_text(), Path("/proc/meminfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    mem = next((ln.split()[1] for ln in meminfo.splitlines() if ln.startswith("MemTotal")), "0")
    return {"cpu": model, "cores": os.cpu_count(), "mem_gib": round(int(mem) / 2**20, 1),
            "amx": "amx_tile" in cpuinfo, "device": "cpu", "python": platform.python_version()}


def summarize(results: dict, workload: dict, hw: dict) -> dict:
    """Per server: pool_tokens, max_concurrency (requests that fit), throughput_tok_s / ttft_ms per
    concurrency, ...; ``tasq_vs_bf16``: capacity ratio and TTFT at concurrency 1 (prefill/encode)."""
    servers = {}
    for name, r in results.items():
        if r.get("status") != "ok":
            servers[name] = {"status": r.get("status", "missing"), "reason": r.get("reason")}
            continue
        pool = r.get("max_total_num_tokens") or 0
        runs = {c: v for c, v in r.get("runs", {}).items() if "error" not in v}
        col = lambda k: {c: v.get(k) for c, v in runs.items()}  # noqa: E731
        servers[name] = {
            "status": "ok", "pool_tokens": pool, "budget_tokens": r.get("budget_tokens"),
            "cell_bytes": r.get("cell_bytes"), "fixed_bytes": r.get("fixed_bytes"), "kv_cache_gb": r.get("kv_cache_gb"),
            "max_concurrency": requests_that_fit(pool, workload["input_len"], workload["output_len"]),
            "server_max_running_requests": r.get("max_running_requests"), "startup_s": r.get("startup_s"),
            "backend": f"{r.get('attention_backend')}, {r.get('kv_cache_dtype')}",
            "throughput_tok_s": col("output_throughput"), "total_throughput_tok_s": col("total_throughput"),
            "ttft_ms": col("mean_ttft_ms"), "median_ttft_ms": col("median_ttft_ms"), "tpot_ms": col("mean_tpot_ms"),
            "server_peak": col("server_peak"), "rounds_tok_s": r.get("rounds_tok_s"),
            "errors": {c: v["error"] for c, v in r.get("runs", {}).items() if "error" in v}}
    out = {"hardware": hw, "workload": {**workload, "tokens_per_request": workload["input_len"] + workload["output_len"]}, "servers": servers}
    b, t = servers.get("bf16", {}), servers.get("tasq", {})
    if b.get("status") == t.get("status") == "ok":
        tb, tt = b["ttft_ms"].get("1"), t["ttft_ms"].get("1")
        thr = {c: round(t["throughput_tok_s"][c] / b["throughput_tok_s"][c], 2)
               for c in t["throughput_tok_s"] if b["throughput_tok_s"].get(c) and t["throughput_tok_s"][c]}
        out["tasq_vs_bf16"] = {"pool_tokens_ratio": round(t["pool_tokens"] / max(b["pool_tokens"], 1), 2),
                               "throughput_ratio": thr,
                               "ttft_c1_ms": {"bf16": tb, "tasq": tt},
                               "ttft_c1_ratio": round(tt / tb, 2) if tb and tt else None,
                               "prefill_overhead_ms": round(tt - tb, 1) if tb and tt else None}
        if workload.get("paired"):
            pr = {c: paired_ratios(t["rounds_tok_s"].get(c, []), b["rounds_tok_s"].get(c, []))
                  for c in t.get("rounds_tok_s") or {}}
            out["tasq_vs_bf16"]["paired_ratios"] = pr
            out["tasq_vs_bf16"]["paired_ratio_median"] = {
                c: round(statistics.median(v), 2) for c, r in pr.items() if (v := [x for x in r if x])}
    return out


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def to_markdown(s: dict) -> str:
    hw, w = s["hardware"], s["workload"]
    lines = ["# Serving: bf16 vs fp8 vs TaSQ KV cache, same KV memory budget", "",
             f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['mem_gib']} GiB RAM ({hw['device']}). "
             f"Model: {w['model']} ({w['model_dir']}). TaSQ artifact: {w['tasq_config']}.",
             f"Workload: `sglang.benchmark.serving` {w['dataset']}, input {w['input_len']} + output "
             f"{w['output_len']} tokens, max({w['num_prompts']}, concurrency) prompts at concurrency {w['concurrency']}; "
             f"KV budget {w['kv_budget_mib']} MiB per server (TaSQ: exact windows for {w['window_rows']} running requests "
             f"included), preset `{w['preset']}`; best of {w.get('rounds', 1)} "
             f"{'paired' if w.get('paired') else 'interleaved'} round(s) per server and concurrency (by output tok/s).", "",
             "| server | attention, KV dtype | bytes/token | pool tokens | KV GB (server) | requests that fit | "
             "server max_running_requests |", "|---|---|---|---|---|---|---|"]
    for n, v in s["servers"].items():
        lines.append(f"| {n} | {v['status']}: {v.get('reason') or ''} | | | | | |" if v["status"] != "ok" else
                     f"| {n} | {v['backend']} | {v['cell_bytes']} | {v['pool_tokens']} | {_f(v['kv_cache_gb'], 3)} | "
                     f"{v['max_concurrency']} | {v['server_max_running_requests']} |")
    lines += ["", "| server | concurrency | output tok/s | total tok/s | mean TTFT ms | median TTFT ms | TPOT ms | "
              "peak running / waiting |", "|---|---|---|---|---|---|---|---|"]
    for n, v in s["servers"].items():
        for c in v.get("ttft_ms", {}):
            lines.append(f"| {n} | {c} | {_f(v['throughput_tok_s'][c], 2)} | {_f(v['total_throughput_tok_s'][c], 1)} | "
                         f"{_f(v['ttft_ms'][c])} | {_f(v['median_ttft_ms'][c])} | {_f(v['tpot_ms'][c])} | "
                         f"{_f(v['server_peak'][c].get('num_running_reqs'))} / {_f(v['server_peak'][c].get('num_waiting_reqs'))} |")
        for c, e in v.get("errors", {}).items():
            lines.append(f"| {n} | {c} | error: {e} | | | | | |")
    r = s.get("tasq_vs_bf16")
    if r:
        ratios = ", ".join(f"{v}x at {c}" for c, v in r.get("throughput_ratio", {}).items())
        lines += ["", f"TaSQ vs bf16: {r['pool_tokens_ratio']}x pool tokens in the same budget; output throughput "
                  f"{ratios or '-'}; TTFT at concurrency 1 "
                  f"{_f(r['ttft_c1_ms']['tasq'])} ms vs {_f(r['ttft_c1_ms']['bf16'])} ms "
                  f"({r['ttft_c1_ratio']}x, prefill + encode overhead {_f(r['prefill_overhead_ms'])} ms)."]
        if r.get("paired_ratio_median"):
            lines += ["", "Paired rounds (servers measured back to back each round): TaSQ/bf16 output throughput, "
                      "median over rounds " + ", ".join(f"{v}x at {c}" for c, v in r["paired_ratio_median"].items())
                      + "; per round " + "; ".join(f"{c}: {r['paired_ratios'][c]}" for c in r["paired_ratios"]) + "."]
    return "\n".join(lines) + "\n"


def write_summary(results: dict, workload: dict, hw: dict, out: Path) -> dict:
    s = summarize(results, workload, hw)  # -> summary.json, summary.md
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    (out / "summary.md").write_text(to_markdown(s))
    return s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CPU preset: " + json.dumps(PRESETS["quick"]))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasq-config", type=Path, default=None,
                    help="TaSQ artifact (default: the first of %s that exists)" % [str(p.relative_to(ROOT)) for p in DEFAULT_ARTIFACTS])
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    for flag, typ, hlp in (("input-len", int, ""), ("output-len", int, ""), ("num-prompts", int, "per run, at least the concurrency"),
                           ("kv-budget-mib", float, "KV MiB for every server; 0 = SGLang's own sizing"),
                           ("window-rows", int, "TaSQ running requests the exact window store holds (SGLANG_TASQ_WINDOW_ROWS), inside the budget")):
        ap.add_argument("--" + flag, type=typ, help=hlp or None)
    ap.add_argument("--concurrency", type=int, nargs="+")
    ap.add_argument("--mem-fraction-static", type=float, default=0.1, help="same for every server")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--bench-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--force", action="store_true", help="rerun servers whose results exist")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds over the servers; each figure is the best round (shared, noisy hosts)")
    ap.add_argument("--paired", action="store_true",
                    help="all servers up at once, measured back to back each round; reports per-round TaSQ/bf16 ratios")
    a = ap.parse_args(argv)
    a.preset = "quick" if a.quick else "full"
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.tasq_config = a.tasq_config or next((p for p in DEFAULT_ARTIFACTS if p.is_file()), None)
    if "tasq" in a.servers and (a.tasq_config is None or not Path(a.tasq_config).is_file()):
        ap.error("tasq needs --tasq-config PATH (no calibrated artifact found)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model_dir = resolve_model(a.model)
    cells = kv_cells(model_dir, a.tasq_config if "tasq" in a.servers else None, a.window_rows)
    budget = int(a.kv_budget_mib * 2**20)
    a.out.mkdir(parents=True, exist_ok=True)
    results, todo = {}, []
    for name in a.servers:
        path = a.out / f"{name}.json"
        if path.is_file() and not a.force:
            print(f"[serving] {name}: reusing {path} (--force reruns)")
            results[name] = json.loads(path.read_text())
        else:
            todo.append(name)
    caps = {n: budget_tokens(budget, *cells[n]) if budget else None for n in todo}
    if a.paired and todo:
        for name, res in run_paired(todo, model_dir, a, caps, a.out / "work").items():
            cell, fixed = cells[name]
            results[name] = dict(res, cell_bytes=cell, fixed_bytes=fixed, budget_tokens=caps[name])
            (a.out / f"{name}.json").write_text(json.dumps(results[name], indent=1) + "\n")
        todo = []
    for rnd in range(a.rounds):  # servers interleaved, so a slow spell of a shared host hits all of them
        for name in todo:
            cell, fixed = cells[name]
            if a.rounds > 1:
                print(f"[serving] round {rnd + 1}/{a.rounds}", flush=True)
            res = run_server(name, model_dir, a, caps[name], a.out / "work")
            res.update(cell_bytes=cell, fixed_bytes=fixed, budget_tokens=caps[name])
            results[name] = merge_best(results.get(name) if rnd else None, res)
            (a.out / f"{name}.json").write_text(json.dumps(results[name], indent=1) + "\n")
    workload = {k: getattr(a, k) for k in ("preset", "input_len", "output_len", "num_prompts", "concurrency",
                                           "kv_budget_mib", "window_rows", "mem_fraction_static", "rounds", "paired")}
    workload.update(model=a.model, model_dir=model_dir.name, dataset="random-ids (range ratio 1.0, seed 1)",
                    tasq_config=os.path.relpath(a.tasq_config, ROOT) if a.tasq_config else None)
    print(to_markdown(write_summary(results, workload, hardware(), a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

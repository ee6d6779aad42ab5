"""The summary of a ``bench.serving`` run: rounds folded per server (:func:`merge_best`), the
per-server table with the TaSQ/bf16 ratios (:func:`summarize`), its markdown, and the host."""
from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path


def requests_that_fit(pool_tokens: int, input_len: int, output_len: int) -> int:
    """Requests whose whole sequence (prompt + output) is resident at once."""
    return pool_tokens // (input_len + output_len)



def paired_ratios(num: list, den: list) -> list:
    """Per-round ratios num[i] / den[i] of two servers' paired rounds (None where either failed)."""
    return [round(x / y, 3) if x and y else None for x, y in zip(num, den)]


def cached_share(run: dict) -> float | None:
    """Share of a run's prompt tokens the server read from its radix cache (None: not recorded)."""
    new, cached = run.get("prefill_tokens"), run.get("cached_tokens")
    if new is None or cached is None or new + cached == 0:
        return None
    return round(cached / (new + cached), 3)


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
            "cached_share": {c: cached_share(v) for c, v in runs.items()},
            "errors": {c: v["error"] for c, v in r.get("runs", {}).items() if "error" in v}}
        tput = {c: v for c, v in servers[name]["throughput_tok_s"].items() if v}
        if tput:  # the paper's shape: each server's best output throughput over the concurrency sweep
            c = max(tput, key=lambda k: (tput[k], -int(k)))
            servers[name]["peak"] = {"output_tok_s": tput[c], "concurrency": int(c),
                                     "running": (runs[c].get("server_peak") or {}).get("num_running_reqs")}
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
        if b.get("peak") and t.get("peak"):
            out["tasq_vs_bf16"]["peak_ratio"] = round(t["peak"]["output_tok_s"] / b["peak"]["output_tok_s"], 2)
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
              "peak running / waiting | prompt tokens from the radix cache |", "|---|---|---|---|---|---|---|---|---|"]
    for n, v in s["servers"].items():
        for c in v.get("ttft_ms", {}):
            lines.append(f"| {n} | {c} | {_f(v['throughput_tok_s'][c], 2)} | {_f(v['total_throughput_tok_s'][c], 1)} | "
                         f"{_f(v['ttft_ms'][c])} | {_f(v['median_ttft_ms'][c])} | {_f(v['tpot_ms'][c])} | "
                         f"{_f(v['server_peak'][c].get('num_running_reqs'))} / {_f(v['server_peak'][c].get('num_waiting_reqs'))} | "
                         f"{_f((v.get('cached_share') or {}).get(c), 3)} |")
        for c, e in v.get("errors", {}).items():
            lines.append(f"| {n} | {c} | error: {e} | | | | | | |")
    r = s.get("tasq_vs_bf16")
    if r:
        ratios = ", ".join(f"{v}x at {c}" for c, v in r.get("throughput_ratio", {}).items())
        ttft = (f"; TTFT at concurrency 1 {_f(r['ttft_c1_ms']['tasq'])} ms vs {_f(r['ttft_c1_ms']['bf16'])} ms "
                f"({r['ttft_c1_ratio']}x, prefill + encode overhead {_f(r['prefill_overhead_ms'])} ms)"
                if r.get("ttft_c1_ratio") else "")
        lines += ["", f"TaSQ vs bf16: {r['pool_tokens_ratio']}x pool tokens in the same budget; output throughput "
                  f"{ratios or '-'}{ttft}."]
        if r.get("peak_ratio"):
            pk = {n: s["servers"][n]["peak"] for n in ("tasq", "bf16")}
            lines += ["", "Peak output throughput over the sweep: " + ", ".join(
                f"{n} {pk[n]['output_tok_s']:.2f} tok/s at concurrency {pk[n]['concurrency']} "
                f"({_f(pk[n]['running'])} running)" for n in pk) + f"; TaSQ / bf16 **{r['peak_ratio']}x**."]
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


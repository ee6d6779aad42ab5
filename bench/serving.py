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
SGLang's own sizing). The radix cache is on, as a server runs by default, and flushed before every
measured run (``sglang.benchmark.serving --flush-cache``: after its warm-up request, which sends
the first prompt): the workload's prompts are the same at every concurrency level and round (seed
1), so without the flush a run would read whole prompts from the cache, more of them the larger
a server's pool (TaSQ's), and time cache hits instead of prefills. Each run records the prompt
tokens the server prefilled and read from its cache (its log's "Prefill batch" lines after the
flush), and the summary prints the share read from the cache (random-id prompts share no
prefix: 0).

Results: one folder per workload, ``bench/results/serving/<run>/`` (``--results ROOT`` moves
the root, ``--out DIR`` names the folder itself), where ``<run>`` is a readable slug of the
workload plus a hash of everything that changes the figures (:func:`workload_key`: model,
artifact content, lengths, prompts, concurrency levels, budget, window rows, memory fraction,
rounds, pairing). It holds ``workload.json``, ``<server>.json`` (reused unless ``--force``,
and only if it records the same run), ``summary.json`` and ``summary.md``; a summary reads only
its own run's results. ``--dry-run`` prints the folder and what would be reused or run.

Noisy hosts: ``--rounds N`` repeats the servers one after another N times (best round kept);
``--paired`` instead keeps every server up (``--sleep-on-idle``) and measures them back to back
within each round, and the summary reports the per-round TaSQ/bf16 throughput ratios and
their median, the figure that survives a host whose speed drifts over minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from sglang_tasq.demo import _free_port, _get, stop_server, wait_ready
from sglang_tasq.options import child_env
from sglang_tasq.models import fingerprint, resolve_model
from sglang_tasq.srt.launch import model_config_dict

from .serving_report import hardware, merge_best, to_markdown, write_summary

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "serving"
# tasq8: --tasq8-config's artifact (TaSQ with fp8 window copies: calibrate serving --exact fp8);
# tasq_salient: --salient-config's (salient tokens); tasq_salient8: --salient8-config's (salient
# tokens and fp8 exact copies); tasq_salient4: --salient4-config's (salient tokens, exact copies as
# codes + a 4-bit residual: --exact res4); the salient ones with --salient-chunk
SERVERS = ("bf16", "fp8", "tasq", "tasq8", "tasq_salient", "tasq_salient8", "tasq_salient4")
SALIENT_SERVERS = ("tasq_salient", "tasq_salient8", "tasq_salient4")
SALIENT_CONFIGS = {"tasq_salient": "salient_config", "tasq_salient8": "salient8_config",
                   "tasq_salient4": "salient4_config"}  # server -> its artifact's option
CHECKED_ARTIFACTS = {"tasq8": ("tasq8_config", "fp8", False), "tasq_salient8": ("salient8_config", "fp8", True),
                     "tasq_salient4": ("salient4_config", "res4", True)}
DEFAULT_ARTIFACTS = (ROOT / "artifacts/smollm2/tasq.json", ROOT / "artifacts/smollm2-fast/tasq.json")
DATASET = "random-ids (range ratio 1.0, seed 1)"
# the workload fields that change the measured figures (with the model, the artifact and the dataset)
KEY_FIELDS = ("input_len", "output_len", "num_prompts", "concurrency", "kv_budget_mib", "window_rows",
              "mem_fraction_static", "rounds", "paired")
# quick: in 96 MiB bf16 holds 4 requests of 1024 + 32 tokens, fp8 8; TaSQ's exact window store
# costs 13.3 MB per running request (SmolLM2), so 96 MiB holds the windows of 4 running requests
# (53 MB) and 24k tokens of codes (8 rows would need 106 MB, more than the budget)
PRESETS = {
    "quick": dict(input_len=1024, output_len=32, num_prompts=4, concurrency=[1, 4, 8], kv_budget_mib=96, window_rows=4),
    "full": dict(input_len=2048, output_len=128, num_prompts=32, concurrency=[1, 4, 16, 32], kv_budget_mib=512,
                 window_rows=32),
    # long prompts, the paper's shape: 400 MiB hold 4 bf16 requests of 4096 + 128 tokens (18,204 slots)
    # and 16 TaSQ ones (16 rows' windows, 213 MB, + 110k slots of codes); concurrency 4 is equal batch
    "long": dict(input_len=4096, output_len=128, num_prompts=16, concurrency=[4, 8, 16], kv_budget_mib=400,
                 window_rows=16)}


def kv_cells(model_dir: Path, manifest: Path | None, window_rows: int, salient: Path | None = None,
             forward_tokens: int = 0, salient8: Path | None = None, tasq8: Path | None = None,
             salient4: Path | None = None) -> dict:
    """{server: (bytes per token slot, fixed bytes)}, the numbers SGLang's pool sizing uses
    (``salient``/``salient8``/``salient4``/``tasq8``: the tasq_salient / tasq_salient8 /
    tasq_salient4 / tasq8 servers' artifacts; ``forward_tokens``: the salient servers' chunked
    prefill size)."""
    fp = fingerprint(model_config_dict(str(model_dir)))
    bf16 = fp.num_kv_heads * 2 * fp.head_dim * fp.num_layers * 2
    cells = {"bf16": (bf16, 0), "fp8": (bf16 // 2, 0)}
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.windows import cell_bytes, store_bytes

    for name, path in (("tasq", manifest), ("tasq8", tasq8), ("tasq_salient", salient), ("tasq_salient8", salient8),
                       ("tasq_salient4", salient4)):
        if path is not None:
            cfg = load_artifact(path).config
            cells[name] = (cell_bytes(cfg, fp.num_kv_heads, fp.head_dim, fp.num_layers),
                           store_bytes(cfg, fp.num_kv_heads, fp.head_dim, fp.num_layers, window_rows, forward_tokens))
    return cells


def budget_tokens(budget_bytes: int, cell: int, fixed: int = 0) -> int:
    """Token slots a pool of ``cell`` bytes each gets from ``budget_bytes`` after ``fixed``."""
    return max(0, (budget_bytes - fixed) // cell)


def server_cmd(name: str, model_dir: Path, port: int, a, max_tokens: int | None) -> list:
    """The ``sglang.launch_server`` command line of server ``name`` (bf16, fp8 or tasq)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "cpu",
           "--disable-cuda-graph", "--host", "127.0.0.1", "--port", str(port),
           "--mem-fraction-static", str(a.mem_fraction_static)]
    cmd += ["--max-total-tokens", str(max_tokens)] if max_tokens else []
    cmd += ["--sleep-on-idle"] if getattr(a, "paired", False) else []
    cmd += ["--disable-radix-cache"] if getattr(a, "disable_radix_cache", False) else []
    if name == "bf16":
        return cmd + ["--attention-backend", "torch_native"]
    if name == "fp8":  # SGLang's CPU fp8 KV cache requires the intel_amx backend (and AMX)
        return cmd + ["--attention-backend", "intel_amx", "--kv-cache-dtype", "fp8_e4m3"]
    if name in SALIENT_SERVERS:
        art = getattr(a, SALIENT_CONFIGS[name])
        return cmd + ["--tasq-config", str(art), "--chunked-prefill-size", str(a.salient_chunk)]
    return cmd + ["--tasq-config", str(a.tasq8_config if name == "tasq8" else a.tasq_config)]


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
           "--seed", "1", "--disable-tqdm", "--flush-cache", "--output-file", str(out)]
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
    env = child_env(SGLANG_TASQ_WINDOW_ROWS=str(a.window_rows))
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
                        **server_state(_get(base + "/get_server_info", timeout=60), _get(base + "/v1/loads", timeout=60)), "runs": {}}


_PREFILL = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")


def prefill_tokens(log: str) -> dict:
    """Prompt tokens a server prefilled and read from its radix cache, summed over the
    "Prefill batch" lines of (a stretch of) its log after its last "Cache flushed" line (the
    measured run's, not its warm-up's)."""
    new = cached = 0
    for m in _PREFILL.finditer(log, log.rfind("Cache flushed") + 1):
        new, cached = new + int(m.group(1)), cached + int(m.group(2))
    return {"prefill_tokens": new, "cached_tokens": cached}


def measure(name: str, base: str, model_dir: Path, a, conc: int, log_dir: Path) -> dict:
    """One run of the workload at ``conc``, with the prompt tokens the server prefilled and read
    from its cache in the measured run."""
    print(f"[serving] {name}: concurrency {conc}", flush=True)
    log = log_dir / f"{name}.log"
    try:
        start = log.stat().st_size
        res = bench_once(base, model_dir, a, conc, log_dir / f"{name}_c{conc}.jsonl")
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return {"error": str(e)[-300:]}
    with open(log, "rb") as f:
        f.seek(start)
        return {**res, **prefill_tokens(f.read().decode(errors="replace"))}


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


# ---- results keyed by the workload ---------------------------------------------------------
def artifact_id(manifest: Path | None) -> str | None:
    """The artifact's identity: a hash of its manifest, which names the tensors file by sha256."""
    return hashlib.sha1(Path(manifest).read_bytes()).hexdigest()[:12] if manifest else None


def workload_key(a) -> dict:
    """Everything that changes the measured figures of a run. Paired runs also depend on which
    servers are up together; interleaved ones measure each server alone, so the server list is
    not part of their key (a later run adds servers to the same folder)."""
    key = {k: getattr(a, k) for k in KEY_FIELDS}
    key.update(model=a.model, dataset=DATASET, artifact=artifact_id(a.tasq_config), radix_cache="flushed per run")
    if "tasq8" in a.servers:
        key.update(tasq8_artifact=artifact_id(a.tasq8_config))
    if "tasq_salient" in a.servers:
        key.update(salient_artifact=artifact_id(a.salient_config), salient_chunk=a.salient_chunk)
    if "tasq_salient8" in a.servers:
        key.update(salient8_artifact=artifact_id(a.salient8_config), salient_chunk=a.salient_chunk)
    if "tasq_salient4" in a.servers:
        key.update(salient4_artifact=artifact_id(a.salient4_config), salient_chunk=a.salient_chunk)
    if a.paired:
        key["servers"] = sorted(a.servers)
    return key


def run_name(key: dict) -> str:
    """``<model>_i<in>o<out>_n<prompts>_c<levels>_kv<MiB>_w<rows>[_r<rounds>][_paired]_<hash>``."""
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    extra = (f"_r{key['rounds']}" if key["rounds"] != 1 else "") + ("_paired" if key["paired"] else "")
    return (f"{Path(key['model']).name}_i{key['input_len']}o{key['output_len']}_n{key['num_prompts']}"
            f"_c{'-'.join(map(str, key['concurrency']))}_kv{key['kv_budget_mib']:g}_w{key['window_rows']}{extra}_{h}")


def plan(a) -> tuple[Path, str, dict, list]:
    """-> (run folder, run name, {server: reused result}, [servers to run]). A ``<server>.json``
    is reused only when it records this run's name (same workload), and never with ``--force``."""
    name = run_name(workload_key(a))
    run_dir = Path(a.out) if a.out else Path(a.results) / name
    reused, todo = {}, []
    for server in a.servers:
        path = run_dir / f"{server}.json"
        prev = json.loads(path.read_text()) if path.is_file() and not a.force else None
        if prev is not None and prev.get("run") == name:
            reused[server] = prev
        else:
            if prev is not None:
                why = f"run {prev['run']}" if prev.get("run") else "no run recorded (older layout)"
                print(f"[serving] {server}: {path} is not this workload's result ({why}), rerunning")
            todo.append(server)
    return run_dir, name, reused, todo


def run_servers(todo: list, model_dir: Path, a, cells: dict, caps: dict, save) -> None:
    """Measure the ``todo`` servers (paired or interleaved rounds); ``save(name, result)`` after each."""
    def stamp(name, res):
        cell, fixed = cells[name]
        return dict(res, cell_bytes=cell, fixed_bytes=fixed, budget_tokens=caps[name])

    if a.paired:
        for name, res in run_paired(todo, model_dir, a, caps, a.run_dir / "work").items():
            save(name, stamp(name, res))
        return
    best = {}
    for rnd in range(a.rounds):  # servers interleaved, so a slow spell of a shared host hits all of them
        for name in todo:
            if a.rounds > 1:
                print(f"[serving] round {rnd + 1}/{a.rounds}", flush=True)
            res = stamp(name, run_server(name, model_dir, a, caps[name], a.run_dir / "work"))
            best[name] = merge_best(best.get(name), res)
            save(name, best[name])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CPU preset: " + json.dumps(PRESETS["quick"]))
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a workload preset (flags given override its fields): " + json.dumps(PRESETS))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasq-config", type=Path, default=None,
                    help="TaSQ artifact (default: the first of %s that exists)" % [str(p.relative_to(ROOT)) for p in DEFAULT_ARTIFACTS])
    ap.add_argument("--tasq8-config", type=Path, default=None,
                    help="the tasq8 server's artifact (calibrate serving ... --exact fp8, no salient tokens)")
    ap.add_argument("--salient-config", type=Path, default=None,
                    help="the tasq_salient server's artifact (calibrate serving --salient ...)")
    ap.add_argument("--salient8-config", type=Path, default=None,
                    help="the tasq_salient8 server's artifact (calibrate serving --salient ... --exact fp8)")
    ap.add_argument("--salient4-config", type=Path, default=None,
                    help="the tasq_salient4 server's artifact (calibrate serving --salient ... --exact res4)")
    ap.add_argument("--salient-chunk", type=int, default=None,
                    help="the salient servers' --chunked-prefill-size (default: the input length, one chunk "
                         "per prompt as the other servers prefill it; a chunk's tokens outside the recent window "
                         "hold exact entries until their block of salient tokens is decided, charged as fixed bytes)")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=["bf16", "fp8", "tasq"])
    for flag, typ, hlp in (("input-len", int, ""), ("output-len", int, ""), ("num-prompts", int, "per run, at least the concurrency"),
                           ("kv-budget-mib", float, "KV MiB for every server; 0 = SGLang's own sizing"),
                           ("window-rows", int, "TaSQ running requests the exact window store holds (SGLANG_TASQ_WINDOW_ROWS), inside the budget")):
        ap.add_argument("--" + flag, type=typ, help=hlp or None)
    ap.add_argument("--concurrency", type=int, nargs="+")
    ap.add_argument("--mem-fraction-static", type=float, default=0.1, help="same for every server")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--bench-timeout", type=float, default=900)
    ap.add_argument("--results", type=Path, default=RESULTS, help="root of the per-workload run folders")
    ap.add_argument("--out", type=Path, default=None, help="this run's folder (default: RESULTS/<run name>)")
    ap.add_argument("--force", action="store_true", help="rerun servers whose results exist")
    ap.add_argument("--dry-run", action="store_true", help="print the run folder and what would be reused or run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds over the servers; each figure is the best round (shared, noisy hosts)")
    ap.add_argument("--paired", action="store_true",
                    help="all servers up at once, measured back to back each round; reports per-round TaSQ/bf16 ratios")
    a = ap.parse_args(argv)
    if a.quick and a.preset not in (None, "quick"):
        ap.error(f"--quick and --preset {a.preset} name two presets")
    a.preset = "quick" if a.quick else (a.preset or "full")
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.kv_budget_mib = int(a.kv_budget_mib) if float(a.kv_budget_mib).is_integer() else a.kv_budget_mib
    a.tasq_config = a.tasq_config or next((p for p in DEFAULT_ARTIFACTS if p.is_file()), None)
    if "tasq" in a.servers and (a.tasq_config is None or not Path(a.tasq_config).is_file()):
        ap.error("tasq needs --tasq-config PATH (no calibrated artifact found)")
    a.salient_chunk = a.salient_chunk or a.input_len
    if "tasq_salient" in a.servers and (a.salient_config is None or not Path(a.salient_config).is_file()):
        ap.error("tasq_salient needs --salient-config PATH (an artifact with salient tokens: calibrate serving --salient)")
    # the servers that serve an artifact of their own: (its option, exact format, salient tokens?)
    for server, (opt, fmt, salient) in CHECKED_ARTIFACTS.items():
        if server not in a.servers:
            continue
        path, flag = getattr(a, opt), "--" + opt.replace("_", "-")
        make = "calibrate serving ART --out DIR" + (" --salient ..." if salient else "") + f" --exact {fmt}"
        if path is None or not Path(path).is_file():
            ap.error(f"{server} needs {flag} PATH ({make})")
        cfg = json.loads(Path(path).read_text()).get("config", {})
        if cfg.get("exact_format") != fmt or bool(cfg.get("salient_budget")) != salient:
            ap.error(f"{flag} {path}: an artifact with {fmt} exact copies and {'' if salient else 'no '}salient "
                     f"tokens is needed ({make})")
    return a


def main(argv=None, *, launch=run_servers) -> int:
    """``launch``: what measures the servers that have no result (:func:`run_servers`)."""
    a = parse_args(argv)
    a.run_dir, name, results, todo = plan(a)
    for server in results:
        print(f"[serving] {server}: reusing {a.run_dir / (server + '.json')} (--force reruns)")
    if a.dry_run:
        print(f"[serving] run folder {a.run_dir} ({'exists' if a.run_dir.is_dir() else 'new'}); "
              f"to run: {' '.join(todo) or 'nothing'}")
        return 0
    model_dir = resolve_model(a.model)
    cells = kv_cells(model_dir, a.tasq_config if "tasq" in a.servers else None, a.window_rows,
                     a.salient_config if "tasq_salient" in a.servers else None, a.salient_chunk,
                     a.salient8_config if "tasq_salient8" in a.servers else None,
                     a.tasq8_config if "tasq8" in a.servers else None,
                     a.salient4_config if "tasq_salient4" in a.servers else None)
    budget = int(a.kv_budget_mib * 2**20)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    art = os.path.relpath(a.tasq_config, ROOT) if a.tasq_config else None
    (a.run_dir / "workload.json").write_text(json.dumps({"run": name, **workload_key(a), "artifact_path": art}, indent=1) + "\n")

    def save(server: str, res: dict) -> None:
        results[server] = dict(res, run=name)
        (a.run_dir / f"{server}.json").write_text(json.dumps(results[server], indent=1) + "\n")

    if todo:
        launch(todo, model_dir, a, cells, {n: budget_tokens(budget, *cells[n]) if budget else None for n in todo}, save)
    workload = {k: getattr(a, k) for k in ("preset", *KEY_FIELDS)}
    workload.update(run=name, model=a.model, model_dir=model_dir.name, dataset=DATASET, tasq_config=art)
    print(to_markdown(write_summary({s: results[s] for s in a.servers if s in results}, workload, hardware(), a.run_dir)))
    print(f"[serving] run folder: {a.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

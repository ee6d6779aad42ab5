"""RULER NIAH through real SGLang servers: the quality suite's "server" view.

For each method the server can run (:func:`server_kind`: bf16, and plain calibrated TaSQ
artifacts at any rate) one ``sglang.launch_server`` on 127.0.0.1 (:func:`bench.serving.server_cmd`'s
CPU recipe, with the radix cache ON, ``--chunked-prefill-size 256`` so that a 1k-2k prompt is
prefilled in several chunks, ``--max-running-requests 4`` and ``--enable-cache-report``) answers
the decode view's samples (:func:`bench.ruler._samples`: same builder, same seed) through
``/v1/completions``, greedy, with the decode view's ``max_tokens``, 4 requests in flight. Once
every first ("cold") answer is in, every sample is sent a second time ("warm"): the radix cache
then holds the prompts, so the second pass reads a radix-shared prefix (the server reports how
many prompt tokens it took from the cache). A TaSQ server's exact store keeps room for the sink and
recent window of :data:`CACHED_WINDOWS` finished prompts (``SGLANG_TASQ_CACHED_WINDOWS``), as
``--mem-fraction-static`` leaves bf16's pool room for every prompt of a pass.

Per task: the score of both passes, the fraction of samples whose two answers are identical
(the TaSQ server's promise: the same request gets the same tokens whatever the cache state) and,
when the decode view's result for the same (method, windows, length, samples) exists in the run
that differs from this one only by ``niah_view``, the fraction of samples where the server's and
the decode view's predictions agree (:func:`same_answer`; the engine's bf16 GEMMs are not HF's,
so this is reported, not asserted). Computed again on every run, so a decode run made later is
picked up by rerunning the server view (its items are reused).

Windows: the served TaSQ keeps its artifact's windows (64 + 256) for every query; the "none"
setting cannot be served and is not run (the log and the summary say so). bf16 has no windows:
its result fills both settings, as in the decode view. Server logs:
``<run>/work/ruler_server/<method>.log``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from . import niah
from .ruler import _found_all, _samples, niah_names, token_cap

CHUNK = 256
CONCURRENCY = 4
MAX_RUNNING = 4
MEM_FRACTION = 0.15  # bf16 at 1k: 64 prompts x ~1k tokens must stay in the radix cache for the warm pass
# TaSQ: the exact store keeps room for the sink + recent window of this many finished prompts
# (SGLANG_TASQ_CACHED_WINDOWS), so that a pass of up to 128 prompts can come back warm whole
CACHED_WINDOWS = 128
# what the server view's numbers depend on besides the suite's config (part of the run name)
SERVER_KEY = {"chunked_prefill_size": CHUNK, "radix_cache": True, "max_running_requests": MAX_RUNNING,
              "concurrency": CONCURRENCY, "mem_fraction_static": MEM_FRACTION, "passes": ["cold", "warm"],
              "cached_windows": CACHED_WINDOWS}
SERVABLE = ("bf16 and plain calibrated TaSQ artifacts: tasq, its rate points tasq@..., tasq_tpN, and layer mixes "
            "BASE+HI@L... from one calibrate --mix-layers artifact")


# ---- which methods, which windows ---------------------------------------------------------
def server_kind(name: str):
    """"bf16" or "tasq": the server that runs method ``name``; None when no server does."""
    from .methods import MixSpec, parse

    spec = parse(name)
    if isinstance(spec, MixSpec):  # served from its one mixed artifact (see served_manifest)
        return "tasq"
    if spec.closed_form == "bf16":
        return "bf16"
    plain = spec.ablation is None and spec.keys and spec.values  # every stage on, both sides coded
    if spec.calib == "tasq" and plain:
        return "tasq"
    return None


def check_servable(names) -> None:
    """ValueError (one line, naming the method) for the first method no server runs."""
    for name in names:
        if server_kind(name) is None:
            raise ValueError(f"niah view 'server': method {name!r} cannot be served (the server runs {SERVABLE}); "
                             f"drop it from --niah-methods or use --niah-view decode")


def served_manifest(name: str, cfg) -> Path:
    """The tasq.json the server runs for TaSQ method ``name``: its artifact; for a layer mix the
    one ``calibrate --mix-layers`` artifact given for its name (the server reads one artifact)."""
    from .methods import MixSpec, artifact_dir, parse

    spec, given = parse(name), dict(cfg.artifacts)
    if isinstance(spec, MixSpec):
        if spec.mixed_artifact_name not in given:
            raise ValueError(f"niah view 'server': layer mix {name!r} is served from one calibrate --mix-layers "
                             f"artifact: pass it as --artifact '{spec.mixed_artifact_name}=DIR'")
        return Path(given[spec.mixed_artifact_name]) / "tasq.json"
    return artifact_dir(spec, Path(cfg.artifact_root), cfg.preset, given) / "tasq.json"


def served_windows(kind: str, manifest=None) -> str:
    """The window setting the server really applies: "none" for bf16, the artifact's for TaSQ."""
    if kind == "bf16":
        return "none"
    w = json.loads(Path(manifest).read_text())["windows"]
    return f"{w['sink']}+{w['recent']}"


# ---- the server -----------------------------------------------------------------------------
def server_command(kind: str, model_dir, port: int, manifest=None) -> list:
    """``bench.serving``'s launch line for ``kind`` with the radix cache on, chunked prefill,
    the request cap and the cache report."""
    from .serving import server_cmd

    a = SimpleNamespace(mem_fraction_static=MEM_FRACTION, tasq_config=manifest)
    cmd = [c for c in server_cmd(kind, Path(model_dir), port, a, None) if c != "--disable-radix-cache"]
    return cmd + ["--chunked-prefill-size", str(CHUNK), "--max-running-requests", str(MAX_RUNNING),
                  "--enable-cache-report"]


@contextlib.contextmanager
def served(kind: str, model_dir, manifest, log_path: Path, timeout: float = 600, log=print):
    """A running server of ``kind`` -> (base URL, state record); stopped on exit."""
    from sglang_tasq.demo import _free_port, _get, log_tail, stop_server, wait_ready
    from sglang_tasq.options import child_env

    from .serving import server_state

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = server_command(kind, model_dir, port, manifest)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"[ruler] server {kind}: {' '.join(cmd[2:])} (log {log_path})")
    with open(log_path, "w") as f:  # the plugin reads the artifact from --tasq-config only
        env = child_env(drop=("SGLANG_TASQ_CONFIG",), SGLANG_TASQ_CACHED_WINDOWS=str(CACHED_WINDOWS))
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    try:
        try:
            wait_ready(base, proc, timeout=timeout)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{kind} server did not start: {e}; last lines of {log_path}:\n"
                               f"{log_tail(log_path, 15)}") from None
        state = {"cmd": cmd[2:], "startup_s": round(time.time() - t0, 1),
                 **server_state(_get(base + "/get_server_info", timeout=60), _get(base + "/v1/loads", timeout=60))}
        yield base, state
    finally:
        stop_server(proc)


def send(base: str, model: str, samples: list, caps: list, concurrency: int = CONCURRENCY) -> list:
    """Every sample's prompt, ``concurrency`` in flight -> [{'text', 'prompt_tokens',
    'completion_tokens', 'cached_tokens'}] in sample order."""
    from .ruler_client import completion

    def one(job):
        s, cap = job
        r = completion(base, model, s["prompt"], cap)
        u = r.get("usage") or {}
        return {"text": r["choices"][0]["text"], "prompt_tokens": u.get("prompt_tokens"),
                "completion_tokens": u.get("completion_tokens"),
                "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, zip(samples, caps, strict=True)))


# ---- scoring (pure) -------------------------------------------------------------------------
def same_answer(decode_pred: str, server_pred: str, gold) -> bool:
    """Whether the server's prediction agrees with the decode view's: the same text, or the
    decode view's is a prefix of it after the decode view stopped early (it stops once every
    gold string is out: later tokens cannot change ``string_match_all``)."""
    a, b = niah.postprocess(decode_pred), niah.postprocess(server_pred)
    return a == b or (bool(a) and _found_all(a, gold) and b.startswith(a))


def _frac(flags: list):
    return round(sum(flags) / len(flags), 4) if flags else None


def _by_task(preds: list, flag) -> dict:
    tasks = dict.fromkeys(p["task"] for p in preds)
    return {t: _frac([bool(flag(p)) for p in preds if p["task"] == t]) for t in tasks}


def _cached_sum(answers: list):
    vals = [a.get("cached_tokens") for a in answers]
    return None if any(v is None for v in vals) else sum(vals)


def summarize(samples: list, cold: list, warm: list) -> dict:
    """Both passes' answers (in sample order) -> the item's scores and per-sample records."""
    if not len(samples) == len(cold) == len(warm):
        raise ValueError(f"{len(samples)} samples, {len(cold)} cold and {len(warm)} warm answers")
    preds = [{"task": s["task"], "index": s["index"], "length": s["length"], "prompt_tokens": c.get("prompt_tokens"),
              "gold": s["outputs"], "pred": c["text"], "pred_warm": w["text"],
              "completion_tokens": c.get("completion_tokens"), "completion_tokens_warm": w.get("completion_tokens"),
              "cached_cold": c.get("cached_tokens"), "cached_warm": w.get("cached_tokens")}
             for s, c, w in zip(samples, cold, warm)]
    tasks = list(dict.fromkeys(p["task"] for p in preds))

    def scores(key):
        return {t: niah.string_match_all([p[key] for p in preds if p["task"] == t],
                                         [p["gold"] for p in preds if p["task"] == t]) for t in tasks}

    cold_s, warm_s = scores("pred"), scores("pred_warm")
    equal = [p["pred"] == p["pred_warm"] for p in preds]
    return {"tasks": cold_s, "avg": sum(cold_s.values()) / len(tasks), "tasks_warm": warm_s,
            "avg_warm": sum(warm_s.values()) / len(tasks), "n_preds": len(preds),
            "warm_equal": _by_task(preds, lambda p: p["pred"] == p["pred_warm"]),
            "warm_equal_all": _frac(equal), "warm_equal_count": sum(equal),
            "prompt_tokens_match": sum(p["prompt_tokens"] == p["length"] for p in preds),
            "cached_tokens": {"prompt": sum(p["length"] for p in preds), "cold": _cached_sum(cold),
                              "warm": _cached_sum(warm)},
            "preds": preds}


AGREE_KEYS = ("agree_decode", "agree_decode_all", "agree_decode_count", "agree_score", "agree_score_all",
              "agree_score_count", "decode_run")


def agreement(item: dict, decode_item, decode_run=None) -> dict:
    """Server vs decode view on the same samples -> the item's agreement fields (all None when
    ``decode_item`` is None or does not hold the same samples). ``agree_decode``: predictions
    agree (:func:`same_answer`); ``agree_score``: the same per-sample score."""
    none = dict.fromkeys(AGREE_KEYS)
    if decode_item is None or decode_item.get("samples_per_task") != item.get("samples_per_task"):
        return none
    dec = {(p["task"], p["index"]): p for p in decode_item.get("preds", [])}
    keys = [(p["task"], p["index"]) for p in item["preds"]]
    if any(k not in dec or dec[k]["gold"] != p["gold"] for k, p in zip(keys, item["preds"])):
        return none
    one = lambda pred, gold: niah.string_match_all([pred], [gold])  # noqa: E731
    agree = {k: same_answer(dec[k]["pred"], p["pred"], p["gold"]) for k, p in zip(keys, item["preds"])}
    same_score = {k: one(dec[k]["pred"], p["gold"]) == one(p["pred"], p["gold"]) for k, p in zip(keys, item["preds"])}
    recs = [{"task": k[0], "a": agree[k], "s": same_score[k]} for k in keys]
    return {"agree_decode": _by_task(recs, lambda r: r["a"]), "agree_decode_all": _frac(list(agree.values())),
            "agree_decode_count": sum(agree.values()), "agree_score": _by_task(recs, lambda r: r["s"]),
            "agree_score_all": _frac(list(same_score.values())), "agree_score_count": sum(same_score.values()),
            "decode_run": decode_run}


def with_decode_preds(item: dict, decode_item) -> list:
    """The item's per-sample records with the decode view's prediction and the agreement flag."""
    dec = {(p["task"], p["index"]): p["pred"] for p in (decode_item or {}).get("preds", [])}
    out = []
    for p in item["preds"]:
        d = dec.get((p["task"], p["index"])) if item.get("decode_run") else None
        agrees = None if d is None else same_answer(d, p["pred"], p["gold"])
        out.append({**p, "decode_pred": d, "agrees_decode": agrees})
    return out


# ---- the bench -------------------------------------------------------------------------------
def measure(base: str, state: dict, ctx, length: int, setting: str) -> dict:
    """One (server, length): the cold pass, then the warm pass -> item."""
    from .ruler_client import served_model

    cfg = ctx.cfg
    samples = [s for t in cfg.niah_tasks for s in _samples(ctx.tok, t, length, cfg.niah_samples, cfg.niah_question)]
    caps = [token_cap(s, cfg.niah_max_new) for s in samples]
    model = served_model(base)
    times = {}
    answers = {}
    for p in ("cold", "warm"):
        ctx.log(f"[ruler] server windows={setting} length={length}: {p} pass, {len(samples)} prompts, "
                f"{CONCURRENCY} in flight")
        t0 = time.time()
        answers[p] = send(base, model, samples, caps)
        times[p] = round(time.time() - t0, 1)
    item = summarize(samples, answers["cold"], answers["warm"])
    preds = item.pop("preds")
    return {**item, "samples_per_task": cfg.niah_samples, "length": length, "view": "server", "windows": setting,
            "server": state, "seconds": round(times["cold"] + times["warm"], 1), "seconds_by_pass": times,
            "preds": preds}


def decode_twin(cfg) -> str:
    """The name of the run that differs from ``cfg``'s only by ``niah_view="decode"``."""
    return dataclasses.replace(cfg, niah_view="decode").name()


def _decode_item(results_root: Path, run: str, name: str, key: str, length):
    from .ruler import item_path

    path = item_path(results_root / run, name, key, length)
    return json.loads(path.read_text()) if path.is_file() else None


def run(ctx) -> dict:
    """Every servable (method, length) not yet done -> item JSON under ``items/ruler_server/``.
    {method: {setting: {length: result}}}, bf16 under both settings, TaSQ under its artifact's."""
    from sglang_tasq.models import resolve_model

    from .report import write_json

    cfg, res = ctx.cfg, {}
    names = niah_names(ctx.methods, cfg.niah_methods)
    check_servable(names)
    twin = decode_twin(cfg)
    for name in names:
        kind = server_kind(name)
        manifest = None
        if kind == "tasq":
            manifest = served_manifest(name, cfg)
        setting = served_windows(kind, manifest)
        if kind == "tasq":
            ctx.log(f"[ruler] server view: {name} is served with its artifact's windows {setting} only; "
                    f"windows 'none' cannot be served and is not measured")
        paths = {n: ctx.run_dir / "items" / "ruler_server" / f"{name}__{setting}__{n}.json" for n in cfg.niah_lengths}
        todo = [n for n, p in paths.items() if not p.is_file()]
        if todo:
            log_path = ctx.run_dir / "work" / "ruler_server" / f"{name}.log"
            with served(kind, resolve_model(cfg.model), manifest, log_path, log=ctx.log) as (base, state):
                for n in todo:
                    write_json(paths[n], measure(base, {**state, "log": str(log_path.relative_to(ctx.run_dir))},
                                                 ctx, n, setting))
        for n, path in paths.items():
            item = json.loads(path.read_text())
            dec = _decode_item(ctx.run_dir.parent, twin, name, setting, n)
            new = {**item, **agreement(item, dec, twin if dec else None)}
            new["preds"] = with_decode_preds(new, dec)
            if new != item:
                write_json(path, new)
            for s in (("none", "64+256") if kind == "bf16" else (setting,)):
                res.setdefault(name, {}).setdefault(s, {})[str(n)] = new
    return res

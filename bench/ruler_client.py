"""RULER NIAH as a client of any running OpenAI-compatible server (bf16, fp8, TaSQ, ...).

``python -m bench.ruler_client --base-url http://127.0.0.1:PORT --lengths 1024 2048 --samples N
[--tasks niah_single_1 ...] [--concurrency 4] [--tokenizer DIR] --out DIR``

Samples come from :mod:`bench.niah` sized with the model's tokenizer and formatted with its
chat template (the answer prefix opens the assistant turn), so the prompt text is complete:
it is sent to ``/v1/completions`` as is, greedy (``temperature 0``), ``max_tokens`` 128, with at
most ``--concurrency`` requests in flight. Scored with ``string_match_all``; writes
``DIR/metrics.json`` (scores per task and length, every prediction, server info) and
``DIR/table.md`` (task x length).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import niah
from sglang_tasq.demo import _get, _post


def served_model(base: str) -> str:
    """The id of the first model the server lists under ``/v1/models``."""
    return _get(base + "/v1/models")["data"][0]["id"]


def completion(base: str, model: str, prompt: str, max_tokens: int = niah.TOKENS_TO_GENERATE,
               timeout: float = 900) -> dict:
    """The whole ``/v1/completions`` answer to ``prompt``, greedy (``temperature 0``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return _post(base + "/v1/completions", body, timeout=timeout)


def complete(base: str, model: str, prompt: str, max_tokens: int = niah.TOKENS_TO_GENERATE,
             timeout: float = 900) -> str:
    return completion(base, model, prompt, max_tokens, timeout)["choices"][0]["text"]


def score(samples: list, preds: list) -> dict:
    """{task: {length: string_match_all}} over samples with fields 'task', 'target', 'outputs'."""
    groups: dict = {}
    for s, p in zip(samples, preds, strict=True):
        g = groups.setdefault(s["task"], {}).setdefault(str(s["target"]), ([], []))
        g[0].append(p)
        g[1].append(s["outputs"])
    return {t: {n: round(niah.string_match_all(*pr), 2) for n, pr in by.items()} for t, by in groups.items()}


def averages(scores: dict, lengths) -> dict:
    """Mean over tasks per length (tasks lacking a length are skipped)."""
    out = {}
    for n in map(str, lengths):
        vals = [by[n] for by in scores.values() if n in by]
        if vals:
            out[n] = round(sum(vals) / len(vals), 2)
    return out


def to_markdown(scores: dict, lengths, title: str) -> str:
    cols = [str(n) for n in lengths]
    lines = [f"# {title}", "", "| task | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for task, by in scores.items():
        lines.append(f"| {task} | " + " | ".join(f"{by[c]:.1f}" if c in by else "-" for c in cols) + " |")
    avg = averages(scores, lengths)
    lines.append("| **average** | " + " | ".join(f"{avg[c]:.1f}" if c in avg else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def build_samples(tok, tasks, lengths, n: int, seed: int) -> list:
    fmt = niah.chat_formatter(tok)
    out = []
    for length in lengths:
        for task in tasks:
            for s in niah.generate_samples(task, tok, length, n, seed=seed, formatter=fmt):
                out.append({**s, "target": length})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ruler_client", description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--samples", type=int, default=4, help="per task and length")
    ap.add_argument("--tasks", nargs="+", default=list(niah.TASKS), choices=list(niah.TASKS))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokenizer", help="HF tokenizer dir (default: the served model path)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--label", default=None, help="name in the table title (e.g. bf16, tasq)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    base = a.base_url.rstrip("/")
    model = served_model(base)
    tok = AutoTokenizer.from_pretrained(a.tokenizer or model)
    samples = build_samples(tok, a.tasks, a.lengths, a.samples, a.seed)
    print(f"[ruler_client] {len(samples)} prompts -> {base} ({model}), {a.concurrency} in flight", flush=True)
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, a.concurrency)) as pool:
        preds = list(pool.map(lambda s: complete(base, model, s["prompt"], s["max_new_tokens"]), samples))
    seconds = round(time.time() - t0, 1)
    scores = score(samples, preds)
    try:
        info = _get(base + "/get_server_info")
        server = {k: info.get(k) for k in ("kv_cache_dtype", "attention_backend", "dtype", "model_path")}
    except (OSError, ValueError):
        server = {}
    metrics = {"base_url": base, "model": model, "server": server, "label": a.label, "lengths": a.lengths,
               "samples_per_task": a.samples, "tasks": a.tasks, "seed": a.seed, "scores": scores,
               "average": averages(scores, a.lengths), "seconds": seconds,
               "preds": [{"task": s["task"], "target": s["target"], "index": s["index"], "length": s["length"],
                          "gold": s["outputs"], "pred": p} for s, p in zip(samples, preds)]}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    title = f"RULER NIAH (string_match_all, {a.samples} samples) - {a.label or model}"
    (a.out / "table.md").write_text(to_markdown(scores, a.lengths, title))
    print((a.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

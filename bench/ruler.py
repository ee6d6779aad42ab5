"""RULER NIAH (all 8 tasks, ``string_match_all``) over the HF model with each KV method.

Samples come from :mod:`bench.niah` (chat-formatted for the instruct model, sized so prompt +
128 generated tokens fit the target length). Generation is greedy, at most 128 new tokens,
through the decode-view attention of :mod:`bench.attention_error`: every prompt token and
every generated token attends as a serving engine's decode step would (sink + recent
windows exact, the rest from codes). It stops at an end-of-sequence token, or as soon as
every gold string already appears in the output: ``string_match_all`` only tests presence,
so later tokens could not change the score (this only saves time).

Views of the suite (``QualityConfig.niah_view``): "decode" (this module, the HF model under the
server's window rule) and "server" (:mod:`bench.ruler_server`: the same samples sent to real
SGLang servers, chunked prefill and radix cache on, each sample twice).
"""
from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import torch

from . import niah
from .attention_error import Probe, ProbeCache, active


VIEWS = ("decode", "server")  # the suite's NIAH views
GREEDY_VIEWS = ("decode", "serving")  # what greedy() emulates on the HF model


def niah_names(methods, niah_methods) -> list:
    """The methods the NIAH bench runs: ``methods`` that ``niah_methods`` names (empty: all)."""
    return [m for m in methods if m in niah_methods] if niah_methods else list(methods)


def token_cap(sample: dict, cap) -> int:
    """Generated-token limit of one sample: its own (RULER's 128), at most ``cap`` when set."""
    return min(sample["max_new_tokens"], cap or sample["max_new_tokens"])


@lru_cache(maxsize=64)
def _samples(tok, task: str, length: int, n: int, question: str = "last", seed: int = 42) -> tuple:
    return tuple(niah.generate_samples(task, tok, length, n, seed, formatter=niah.chat_formatter(tok),
                                       question=question))


def _eos_ids(model, tok) -> set:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    return ids | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def _found_all(text: str, gold) -> bool:
    low = niah.postprocess(text).lower()
    return all(g.lower() in low for g in gold)


@torch.no_grad()
def greedy(model, tok, prompt: str, method, sink: int, recent: int, gold=(), max_new: int = 128,
           view: str = "decode", salient=None, split: int | None = None, side: str = "bf16") -> str:
    """Greedy continuation of ``prompt`` (no special tokens added) under ``method``.

    view "decode": prompt tokens attend through the windows too (the rule of
    ``sglang_tasq.windows``, which the TaSQ server applies to every query since the window
    change); "serving": the prompt attends exactly, as the server's one-chunk prefill did before
    that change, and every generated token reads the prompt from codes outside the windows (an
    HF-level reference only: the suite no longer offers it, its "server" view measures the real
    server instead).

    salient: a :class:`sglang_tasq.salient.SalientSpec` (decode view): tokens kept exact, chosen
    when the prompt's first ``split`` tokens have been read (default: the whole prompt); the
    prompt is then run as two forwards, ``[:split]`` and the rest (the question asked later).
    side: how the exact copies are held (:class:`bench.attention_error.ProbeCache`)."""
    if view not in GREEDY_VIEWS:
        raise ValueError(f"view {view!r}: allowed {GREEDY_VIEWS}")
    ids = torch.tensor(tok(prompt, add_special_tokens=False)["input_ids"])
    eos, out = _eos_ids(model, tok), []
    cache = ProbeCache(method, side)
    if salient is not None and view != "decode":
        raise ValueError("salient tokens are measured in the decode view")
    split = len(ids) if split is None else split
    if not 0 < split <= len(ids):
        raise ValueError(f"split {split} outside the prompt's {len(ids)} tokens")
    probe = Probe(cache, len(ids), 0) if view == "serving" else Probe(cache, sink, recent, salient=salient,
                                                                       select_at=split)
    with active(probe):
        for part in (ids[:split], ids[split:]):
            if len(part):
                h = model.model(input_ids=part[None], past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        probe.sink, probe.recent = sink, recent
        for _ in range(max_new):
            nxt = int(model.lm_head(h).argmax())
            if nxt in eos:
                break
            out.append(nxt)
            if gold and _found_all(tok.decode(out, skip_special_tokens=True), gold):
                break
            h = model.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache,
                            use_cache=True).last_hidden_state[0, -1]
    return tok.decode(out, skip_special_tokens=True)


def evaluate(model, tok, method, sink: int, recent: int, length: int, n: int, tasks=tuple(niah.TASKS),
             max_new: int | None = None, view: str = "decode", question: str = "last") -> dict:
    """{'tasks': {task: 0-100}, 'avg': mean over tasks, 'preds': [...], 'seconds'}.

    max_new: cap on generated tokens (None: RULER's 128). Answers come first (up to four
    7-digit numbers or UUIDs, < 64 tokens), so the quick preset's cap of 64 only shortens
    the runs of a method that never produces them."""
    t0, scores, preds = time.time(), {}, []
    for task in tasks:
        samples = _samples(tok, task, length, n, question)
        outs = [greedy(model, tok, s["prompt"], method, sink, recent, s["outputs"], token_cap(s, max_new),
                       view) for s in samples]
        scores[task] = niah.string_match_all(outs, [s["outputs"] for s in samples])
        preds += [{"task": task, "index": s["index"], "length": s["length"], "gold": s["outputs"], "pred": o}
                  for s, o in zip(samples, outs)]
    return {"tasks": scores, "avg": sum(scores.values()) / len(scores), "samples_per_task": n,
            "length": length, "view": view, "preds": preds, "seconds": round(time.time() - t0, 1)}


def item_path(run_dir, name: str, key: str, length) -> Path:
    """Where the decode view keeps one (method, window setting, length) result."""
    return run_dir / "items" / "ruler" / f"{name}__{key}__{length}.json"


def run(ctx, settings=("none", "64+256")) -> dict:
    """Every (length, method, setting) not yet done -> item JSON. {method: {setting: {length: result}}}.
    The "server" view is :func:`bench.ruler_server.run`."""
    from .methods import parse_windows
    from .report import cached

    cfg, res = ctx.cfg, {}
    if cfg.niah_view == "server":
        from . import ruler_server

        return ruler_server.run(ctx)
    names = niah_names(ctx.methods, cfg.niah_methods)
    for length in cfg.niah_lengths:
        for name in names:
            for setting in settings:
                key = "none" if name == "bf16" else setting
                path = item_path(ctx.run_dir, name, key, length)

                def work():
                    ctx.log(f"[ruler] {name} windows={key} length={length} n={cfg.niah_samples}")
                    return evaluate(ctx.model, ctx.tok, ctx.methods[name], *parse_windows(key), length,
                                    cfg.niah_samples, cfg.niah_tasks, cfg.niah_max_new, "decode", cfg.niah_question)

                res.setdefault(name, {}).setdefault(setting, {})[str(length)] = cached(path, work)
    return res

"""Does the salient selection find the needle? (issue 14's diagnosis of retrieval at 2k)

    python -m bench.salient_recall --lengths 1024 2048 --samples 8 \\
        --points tasq:64+256:S128a12 --artifact tasq=artifacts/smollm2

For each RULER NIAH sample of :mod:`bench.retrieval` (same samples, same decode view), the
prompt is read up to the selection point and the salient rule of :mod:`sglang_tasq.salient`
chooses its kept positions, exactly as in a retrieval run; no answer is generated. Then the
needle's value tokens (every prompt token overlapping an occurrence of a gold answer string
before the selection point) are compared with what was kept:

- ``gold_candidates``: value tokens the query at the selection point reads from codes (outside
  the windows); a sample with none is reported but not scored (its needle is exact anyway);
- ``recall``: the share of those kept exact (per (layer, KV head) sets: averaged over them);
- ``best_rank``: the rank of the best-scored value token among all candidates, by the scores
  summed over layers and heads (0 = the top; the budget is the cut; rule "both": by the
  last-queries scores, which choose the first half);
- ``kept`` (shared sets only): the kept positions, the set generation reads exactly;
- ``recall_by_layer`` (streaming points, ``S<b>/<N>L<l>...e``): the recall had the blocks been
  decided at each layer ``0 .. l`` (the echo summed up to it), from the same forward.

``--seed`` draws other samples than the NIAH benches' (42 + i), for choosing a setting on data
the retrieval runs do not score (a run folder of its own).

The summary joins each sample with its retrieval score under the point and under
``--base`` (default ``tasq:64+256``, no kept tokens; ``:first`` added for a question-first point) when
those items are in the run folder:
whether the samples a selection finds are the ones it rescues. Written to
``<retrieval run folder>/recall/`` (one JSON per point and length, ``recall.md``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import methods as M
from . import niah, stats
from .report import write_json
from .retrieval import RESULTS, Point, per_sample, question_split, run_name


def gold_positions(tok, prompt: str, gold, end: int) -> list:
    """Token indices (< ``end``) of ``prompt`` overlapping any occurrence of a gold string."""
    offsets = tok(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = []
    for g in gold:
        at = prompt.find(g)
        while at >= 0:
            spans.append((at, at + len(g)))
            at = prompt.find(g, at + 1)
    return sorted({i for i, (s, e) in enumerate(offsets[:end]) for a, b in spans if s < b and e > a and e > s})


def selection(model, tok, method, point: Point, sample: dict) -> dict:
    """Run the prompt to the selection point under ``point``'s rule -> the sample's record."""
    import torch

    from sglang_tasq import salient as sal

    from .attention_error import Probe, ProbeCache, active

    spec = point.salient()
    if spec is None:
        raise ValueError(f"point {point.name} keeps no salient tokens: nothing to measure")
    ids = torch.tensor(tok(sample["prompt"], add_special_tokens=False)["input_ids"])
    T = question_split(tok, sample) if point.later else len(ids)
    probe = Probe(ProbeCache(method), point.sink, point.recent, salient=spec, select_at=T)
    with torch.no_grad(), active(probe):
        model.model(input_ids=ids[:T][None], past_key_values=probe.cache, use_cache=True)
    lo, hi = sal.candidates(T, point.sink, point.recent)
    gold = gold_positions(tok, sample["prompt"], sample["outputs"], T)
    cand = [p for p in gold if lo <= p < hi]
    rec = {"task": sample["task"], "index": sample["index"], "T": T, "gold_tokens": len(gold),
           "gold_candidates": len(cand), "recall": None, "best_rank": None}
    if not cand:
        return rec
    if spec.block is not None:
        return _streaming_record(probe, spec, rec, cand, T)
    layers = [probe.scores[i] for i in sorted(probe.scores)]
    if spec.shared:
        second = [probe.echo[i] for i in sorted(probe.echo)] or None
        kept = [set(sal.select_shared(layers, point.sink, point.recent, spec, second).tolist())]
        rec["kept"] = sorted(kept[0])
    else:
        kept = [set(row.tolist()) for i in sorted(probe.scores) for row in
                sal.top_union(probe.scores[i], probe.echo.get(i), point.sink, point.recent, spec.budget)]
    rec["recall"] = sum(sum(p in k for p in cand) / len(cand) for k in kept) / len(kept)
    total = torch.stack([s.float() for s in layers]).sum((0, 1))[lo:hi]
    order = torch.sort(-total, stable=True).indices  # the selection's order (ties to the lower)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    rec["best_rank"] = int(min(rank[p - lo] for p in cand))
    return rec


def _streaming_record(probe, spec, rec: dict, cand: list, T: int) -> dict:
    """A streaming spec's record ``rec`` completed: recall of the value tokens read from codes
    (``cand``) among the tokens its decided blocks keep; ``best_rank``: the best value token's rank
    inside its own block (the budget is per block)."""
    import torch

    from sglang_tasq import salient as sal

    kept = probe.kept.get("all", torch.empty(0, dtype=torch.long))
    rec["kept"] = kept.tolist()
    rec["recall"] = sum(p in set(rec["kept"]) for p in cand) / len(cand)
    from .attention_error import stream_rows

    rows = stream_rows(probe, T)
    c = sal.pooled(sal.above_local_median(rows.float()), spec.reach).sum(0)
    ranks = []
    for p in cand:
        b0 = max(p // spec.block * spec.block, probe.sink)
        blk = c[b0: (p // spec.block + 1) * spec.block]
        ranks.append(int((blk > c[p]).sum()) + int((blk[: p - b0] == c[p]).sum()))
    rec["best_rank"] = min(ranks)
    # the same budget decided at each layer instead (layers up to the point's own: one forward
    # holds their echo, which no kept token changes before the deciding layer)
    H, by = rows.shape[0] // (spec.layer + 1), []
    for layer in range(spec.layer + 1):
        kept_l = set(sal.decide_blocks(rows[: (layer + 1) * H], T, 0, probe.sink, spec).tolist())
        by.append(round(sum(p in kept_l for p in cand) / len(cand), 4))
    rec["recall_by_layer"] = by
    return rec


def summarize(recs: list, point_scores: dict | None, base_scores: dict | None, budget: int) -> dict:
    """One (point, length): recall with its interval, and retrieval split by whether the
    selection kept every value token the query reads from codes."""
    scored = [r for r in recs if r["recall"] is not None]
    out = {"samples": len(recs), "scored": len(scored),
           "needle_in_windows": len(recs) - len(scored),
           "recall_pct": vars(stats.mean_interval([100.0 * r["recall"] for r in scored])) if scored else None,
           "all_kept": sum(r["recall"] == 1.0 for r in scored), "budget": budget,
           "median_best_rank": statistics.median(r["best_rank"] for r in scored) if scored else None,
           "best_in_budget": sum(r["best_rank"] < budget for r in scored)}
    for name, sc in (("point", point_scores), ("base", base_scores)):
        if sc is None:
            continue
        for group, keep in (("all_kept", lambda r: r["recall"] == 1.0), ("missed", lambda r: r["recall"] < 1.0)):
            vals = [sc[(r["task"], r["index"])] for r in scored if keep(r) and (r["task"], r["index"]) in sc]
            out[f"niah_{name}_{group}"] = {"mean": round(sum(vals) / len(vals), 1) if vals else None, "n": len(vals)}
    return out


def table(rows: list) -> str:
    head = ("| length | point | samples (needle in windows) | recall of value tokens, % [95%] | all kept | best value "
            "token's median rank (in budget) | NIAH, all kept: point / base | NIAH, missed: point / base |\n"
            "|---|---|---|---|---|---|---|---|\n")

    def niah_cell(s, group):
        p, b = s.get(f"niah_point_{group}"), s.get(f"niah_base_{group}")
        if p is None:
            return "-"
        return f"{p['mean']} / {b['mean'] if b else '-'} (n={p['n']})"

    body = "".join(
        f"| {r['length']} | {r['point']} | {s['samples']} ({s['needle_in_windows']}) "
        f"| {stats.text(s['recall_pct']) if s['recall_pct'] else '-'} | {s['all_kept']}/{s['scored']} "
        f"| {s['median_best_rank']} ({s['best_in_budget']}/{s['scored']} < {s['budget']}) "
        f"| {niah_cell(s, 'all_kept')} | {niah_cell(s, 'missed')} |\n"
        for r in rows for s in [r["summary"]])
    return head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.salient_recall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", required=True, help="salient points of bench.retrieval, e.g. tasq:64+256:S128a12")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tasks", nargs="+", default=list(niah.TASKS))
    ap.add_argument("--base", default="tasq:64+256", help="the point without kept tokens to compare with")
    ap.add_argument("--seed", type=int, default=42, help="first sample seed (the NIAH benches' is 42)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--preset", default="default", choices=("default", "fast"))
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--artifact-root", default="artifacts/quality")
    ap.add_argument("--results", default=str(RESULTS))
    a = ap.parse_args(argv)
    try:
        points = [Point.parse(p) for p in a.points]
        if any(p.salient() is None for p in points):
            raise ValueError("every point must keep salient tokens (:sB or :SB)")
        overrides = dict(kv.split("=", 1) for kv in a.artifact)
    except ValueError as e:
        print(f"bench.salient_recall: {e}", file=sys.stderr)
        return 2

    from sglang_tasq.models import dtype_name, fingerprint, load_config, resolve_model

    from .perplexity import load_model
    from .ruler import _samples

    model, tok = load_model(a.model)
    fp = fingerprint(load_config(resolve_model(a.model)))
    built = {}
    for name in dict.fromkeys(p.method for p in points):
        spec = M.parse(name)
        built[name] = M.build(spec, M.ensure_artifact(spec, a.model, a.preset, Path(a.artifact_root), overrides), fp)
    run_dir = Path(a.results) / (run_name(a.model, a.preset, a.samples, a.tasks, None, dtype_name(model.dtype))
                                 + ("" if a.seed == 42 else f"_s{a.seed}"))
    for length in a.lengths:
        for p in points:
            path = run_dir / "recall" / f"{p.slug}__{length}.json"
            if not path.is_file():
                t0 = time.time()
                recs = [selection(model, tok, built[p.method], p, s) for task in a.tasks
                        for s in _samples(tok, task, length, a.samples, p.question, a.seed)]
                write_json(path, {"point": p.name, "length": length, "samples": recs,
                                  "seconds": round(time.time() - t0, 1)})
    rows = []
    for path in sorted((run_dir / "recall").glob("*__*.json")):  # every point any run put here
        rec = json.loads(path.read_text())
        p, length = Point.parse(rec["point"]), rec["length"]
        items = {}
        base = replace(Point.parse(a.base), first=p.first).name  # the base on the same prompts
        for name in (p.name, base):
            f = run_dir / "items" / f"{Point.parse(name).slug}__{length}.json"
            items[name] = per_sample(json.loads(f.read_text())) if f.is_file() else None
        s = summarize(rec["samples"], items[p.name], items[base], p.budget)
        rows.append({"point": p.name, "length": length, "summary": s})
        print(f"[salient_recall] {p.name} length={length}: {json.dumps(s)}", flush=True)
    rows.sort(key=lambda r: (r["length"], r["point"]))
    md = table(rows)
    (run_dir / "recall" / "recall.md").write_text(
        f"# Salient selection against the needle, {a.model}, decode view, {a.samples} samples per task\n\n"
        f"Recall interval: {stats.DESCRIPTION}. Base point: {a.base}.\n\n" + md)
    write_json(run_dir / "recall" / "summary.json", rows)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

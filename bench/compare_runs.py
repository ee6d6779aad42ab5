"""``python -m bench.compare_runs``: one retrieval point of two :mod:`bench.retrieval` run folders,
paired sample by sample: two fits, two code versions of the calibration, two hosts; or two points
kept in different folders (``--point-b``: e.g. a question-first point against its question-last one,
whose samples hold the same needles, haystacks and keys).

A run folder holds one artifact per name (``artifacts.json``), so two fits of the same method (the
artifact before and after a calibration change) live in two folders. Their items are the same
samples when the workload is the same (model, preset, samples per task, tasks, token cap, model
dtype: :data:`bench.pareto.SAME_WORKLOAD`) and every sample's gold answers agree; this checks both,
then reports each side's NIAH [95%] and ``B - A`` paired per sample (bootstrap stratified by task,
:func:`bench.retrieval.paired`), per length, with the artifacts' sha256 (which must differ, or the
two folders measured one fit)::

    python -m bench.compare_runs --a before=bench/results/retrieval/issue13_before/RUN \\
        --b after=bench/results/retrieval/issue13_after/RUN --point tasq:64+256 --lengths 2048 4096 \\
        --out bench/results/retrieval/issue13_before_after.md

A side may also be a :mod:`bench.quality` run of the NIAH **server view** (``--niah-view server``:
real SGLang servers answering the same samples; its cold pass is compared): the served method is
the point's method with the point's windows, the run's question order must be the point's, and the
samples must be the same (model, samples per task, tasks, token cap; gold answers checked per
sample). What the artifact keeps besides (salient tokens, fp8 copies) is the artifact's: both
sides' artifact ids are printed::

    python -m bench.compare_runs --a decode=bench/results/retrieval/echo/RUN \\
        --b server=bench/results/quality/salient_served8/RUN --point "tasq:64+256:S36/192L17a12e:x8:first"
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import methods as M
from . import stats
from .pareto import workload
from .retrieval import Point, _by_task, paired, per_sample


def _side(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: LABEL=RUN_DIR, e.g. before=bench/results/retrieval/x/RUN")
    return label, Path(path)


#: the workload fields a retrieval run and a quality run's server view share (the server's model
#: dtype and the quality preset are the server's and the artifact's own)
SERVER_WORKLOAD = ("model", "samples", "tasks", "max_new")


def _raw_config(run: Path) -> dict:
    path = run / "config.json"
    if not path.is_file():
        raise ValueError(f"{run}: no config.json (not a bench.retrieval or bench.quality run folder)")
    return json.loads(path.read_text())


def _is_server(run: Path) -> bool:
    return _raw_config(run).get("niah_view") == "server"


def _config(run: Path) -> dict:
    cfg = _raw_config(run)
    if cfg.get("niah_view") == "server":  # a bench.quality run, server view
        return {"model": cfg["model"], "samples": cfg["niah_samples"], "tasks": cfg["niah_tasks"],
                "max_new": cfg["niah_max_new"], "question": cfg.get("niah_question", "last")}
    return workload(cfg)


def _item(run: Path, point: Point, length: int) -> dict:
    if _is_server(run):
        order = _config(run)["question"]
        if point.later or order != point.question:
            raise ValueError(f"{run}: its server view asked the question {order}, {point.name} asks it "
                             f"{'later' if point.later else point.question}")
        windows = "none" if point.sink + point.recent == 0 else f"{point.sink}+{point.recent}"
        path = run / "items" / "ruler_server" / f"{point.method}__{windows}__{length}.json"
    else:
        path = run / "items" / f"{point.slug}__{length}.json"
    if not path.is_file():
        raise ValueError(f"{run}: no item for {point.name} at {length} tokens ({path.name})")
    item = json.loads(path.read_text())
    if "mean_length" not in item:  # a server item: the prompts' token counts per sample
        item["mean_length"] = sum(p["length"] for p in item["preds"]) / max(1, len(item["preds"]))
    return item


def compare(a: tuple[str, Path], b: tuple[str, Path], point: str, lengths, point_b: str | None = None) -> list[dict]:
    """Rows {length, a, b, b_minus_a, n} for ``point`` in A's run folder and ``point_b`` (default: the
    same point) in B's (ValueError when they are not the same workload, their samples' gold answers
    differ, or an item is missing)."""
    (la, ra), (lb, rb) = a, b
    ca, cb = _config(ra), _config(rb)
    if _is_server(ra) or _is_server(rb):
        ca, cb = ({k: c[k] for k in SERVER_WORKLOAD} for c in (ca, cb))
    if ca != cb:
        raise ValueError(f"{ra} and {rb} are different workloads (field: (A, B)) "
                         f"{ {k: (ca[k], cb[k]) for k in ca if ca[k] != cb[k]} }")
    p, pb = Point.parse(point), Point.parse(point_b or point)
    rows = []
    for length in lengths:
        ia, ib = _item(ra, p, length), _item(rb, pb, length)
        gold_a = {(s["task"], s["index"]): s["gold"] for s in ia["preds"]}
        gold_b = {(s["task"], s["index"]): s["gold"] for s in ib["preds"]}
        if gold_a != gold_b:
            raise ValueError(f"{p.name} / {pb.name} at {length}: the two items' samples differ (gold answers)")
        sa, sb = per_sample(ia), per_sample(ib)
        rows.append({"length": length, "mean_length": round(ia["mean_length"], 1), "n": len(sa),
                     la: vars(stats.stratified_interval(_by_task(sa))),
                     lb: vars(stats.stratified_interval(_by_task(sb))),
                     "b_minus_a": paired(sa, sb),
                     "b_up": sum(sb[k] > sa[k] for k in sa),
                     "b_down": sum(sb[k] < sa[k] for k in sa)})
    return rows


def _shas(run: Path) -> dict:
    path = run / "artifacts.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def markdown(a, b, point: str, rows: list, point_b: str | None = None) -> str:
    (la, ra), (lb, rb) = a, b
    what = point if point_b in (None, point) else f"{point} ({la}) and {point_b} ({lb})"
    head = [f"# {what}: {lb} against {la}, paired per sample", "",
            f"- {la}: `{ra}` (artifacts {', '.join(f'{k} {M.short_id(v)}' for k, v in _shas(ra).items()) or '-'})",
            f"- {lb}: `{rb}` (artifacts {', '.join(f'{k} {M.short_id(v)}' for k, v in _shas(rb).items()) or '-'})",
            f"- Intervals: {stats.DESCRIPTION}, stratified by task.", "",
            f"| length (mean prompt) | samples | {la} NIAH [95%] | {lb} NIAH [95%] | {lb} - {la} [95%] | answers up / down |",
            "|---|---|---|---|---|---|"]
    body = [f"| {r['length']} ({r['mean_length']:.0f}) | {r['n']} | {stats.text(r[la])} | {stats.text(r[lb])} "
            f"| {stats.text(r['b_minus_a'])} | {r['b_up']} / {r['b_down']} |" for r in rows]
    return "\n".join(head + body) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=_side, required=True, metavar="LABEL=RUN_DIR")
    ap.add_argument("--b", type=_side, required=True, metavar="LABEL=RUN_DIR")
    ap.add_argument("--point", default="tasq:64+256")
    ap.add_argument("--point-b", help="B's point, when it is not --point (the same samples, another point)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--out", help="also write the markdown table (and FILE.json) here")
    a = ap.parse_args(argv)
    if a.a[0] == a.b[0]:
        print("bench.compare_runs: the two sides need different labels", file=sys.stderr)
        return 2
    try:
        rows = compare(a.a, a.b, a.point, a.lengths, a.point_b)
    except ValueError as e:
        print(f"bench.compare_runs: {e}", file=sys.stderr)
        return 2
    md = markdown(a.a, a.b, a.point, rows, a.point_b)
    print(md)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

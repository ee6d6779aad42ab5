"""``python -m bench.pareto``: the retrieval-against-bits frontier (issue 14) from run folders.

Joins the ``summary.json`` of one or more :mod:`bench.retrieval` run folders (each a length, or
several; the same model, preset, samples, tasks and model dtype, checked) with, optionally, a
:mod:`bench.quality` perplexity run (its no-window PPL and logit NMSE per method, on the same
artifacts, checked by sha256). One row per point; per length its bits per element all-in (at that
length's mean prompt), NIAH with its 95% interval and its share of bf16's NIAH at that length.

A point is on the frontier at a length when no other point measured there has fewer or equal bits
all-in and a higher NIAH (or equal NIAH at fewer bits). The target (``--share``, ``--max-bits``;
the issue's 0.9 of bf16 at <= 1.6 bits) is met by a point whose every measured length reaches the
share within the bits; the summary names the cheapest point meeting it, or says that none does.
A point measured at fewer lengths than others is reported, but only judged on what it has. Points
of the question-first prompts (``...:first``, :mod:`bench.retrieval`) are another workload: their
share is of ``bf16:first``, their frontier is drawn among ``first`` points only, and the target gets
one verdict per question order present::

    python -m bench.pareto --retrieval bench/results/retrieval/mix1k/smollm2-135m_default_n8_4e0064e2 \\
        bench/results/retrieval/len2k/smollm2-135m_default_n8_4e0064e2 \\
        --quality bench/results/quality/pareto/smollm2-135m_full_default_XXXX --out bench/results/pareto/run
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import stats
from .report import write_json

# the config fields that make two retrieval runs' samples the same samples
SAME_WORKLOAD = ("model", "preset", "samples", "tasks", "max_new", "model_dtype")


def workload(cfg: dict) -> dict:
    """The fields of a retrieval run's ``config.json`` that make two runs' samples the same samples."""
    work = {k: cfg.get(k) for k in SAME_WORKLOAD}
    work["model_dtype"] = work["model_dtype"] or "bfloat16"  # runs before the field: bf16 (see run_name)
    return work


def _read(path: Path, what: str):
    if not path.is_file():
        raise ValueError(f"{path.parent}: no {path.name} ({what})")
    return json.loads(path.read_text())


def _method(point: str) -> str:
    return point.split(":", 1)[0]


def question(point: str) -> str:
    """The prompts a point was measured on: "first" (question before the haystack) or "last"."""
    return "first" if point.endswith(":first") else "last"


def _bf16(point: str) -> str:
    """The bf16 point of the same prompts."""
    return "bf16:first" if question(point) == "first" else "bf16"


def _check_artifacts(seen: dict, ids: dict, where: Path) -> None:
    """One sha256 per artifact name across every run folder joined."""
    for name, sha in ids.items():
        if name in seen and seen[name][0] != sha:
            raise ValueError(f"artifact {name!r} differs between {seen[name][1]} ({seen[name][0][:12]}) and "
                             f"{where} ({sha[:12]}): these runs measured different fits")
        seen.setdefault(name, (sha, where))


def load_retrieval(dirs) -> tuple[dict, dict, dict]:
    """({(point, length): summary row}, the shared workload config, {artifact: (sha, dir)})."""
    rows, config, arts = {}, None, {}
    for d in map(Path, dirs):
        work = workload(_read(d / "config.json", "a bench.retrieval run folder"))
        if config is None:
            config = work
        elif work != config:
            diff = {k: (config[k], work[k]) for k in SAME_WORKLOAD if config[k] != work[k]}
            raise ValueError(f"{d}: another workload than the first run folder's (field: (first, this)) {diff}")
        _check_artifacts(arts, _read(d / "artifacts.json", "the run's artifact sha256") if (d / "artifacts.json").is_file()
                         else {}, d)
        for r in _read(d / "summary.json", "run bench.retrieval --report-only"):
            key = (r["point"], r["length"])
            if key in rows and rows[key]["niah"]["mean"] != r["niah"]["mean"]:
                raise ValueError(f"{r['point']} at {r['length']} differs between run folders "
                                 f"({rows[key]['niah']['mean']:.1f} vs {r['niah']['mean']:.1f})")
            rows[key] = r
    if not rows:
        raise ValueError("no retrieval rows in the run folders given")
    return rows, config, arts


def load_quality(d: Path, arts: dict) -> dict:
    """{(method, windows): quality summary row} of a bench.quality run on the same artifacts."""
    _check_artifacts(arts, _read(d / "artifacts.json", "the run's artifact sha256") if (d / "artifacts.json").is_file()
                     else {}, d)
    return {(r["method"], r["windows"]): r for r in _read(d / "summary.json", "a bench.quality run folder")}


def frontier(points: dict) -> set:
    """{name: (bits all-in, NIAH mean)} -> the names no other point dominates."""
    out = set()
    for name, (b, s) in points.items():
        if not any((b2 <= b and s2 > s) or (b2 < b and s2 >= s)
                   for other, (b2, s2) in points.items() if other != name):
            out.add(name)
    return out


def table(rows: dict, quality: dict, share: float, max_bits: float) -> tuple[list, str, str]:
    """(per-point records, the markdown table, the verdict: one line per question order present)."""
    lengths = sorted({length for _, length in rows})
    def order(p):  # question last first; bf16 first, then by bits all-in at the shortest length measured
        first = min(n for q, n in rows if q == p)
        return question(p) == "first", p != _bf16(p), first, rows[(p, first)]["bits_all_in"], p

    names = sorted({p for p, _ in rows}, key=order)
    orders = sorted({question(p) for p in names}, key=("last", "first").index)
    fronts = {(length, o): frontier({p: (r["bits_all_in"], r["niah"]["mean"]) for (p, n), r in rows.items()
                                     if n == length and question(p) == o})
              for length in lengths for o in orders}
    records = []
    for p in names:
        rec = {"point": p, "bits_codes": next(r["bits_codes"] for (q, _), r in rows.items() if q == p), "lengths": {}}
        for length in lengths:
            r = rows.get((p, length))
            if r is None:
                continue
            base = rows.get((_bf16(p), length))
            sh = r["niah"]["mean"] / base["niah"]["mean"] if base and base["niah"]["mean"] > 0 else None
            rec["lengths"][length] = {"mean_length": r["mean_length"], "bits_all_in": r["bits_all_in"],
                                      "niah": r["niah"], "share_of_bf16": sh,
                                      "frontier": p in fronts[(length, question(p))]}
        q = quality.get((_method(p), "none"))
        if q is not None:
            rec["ppl_none"], rec["logit_nmse_none"] = q["ppl_wiki"], q["logit_nmse"]
        at = rec["lengths"].values()
        rec["question"] = question(p)
        rec["meets"] = p != _bf16(p) and all(v["share_of_bf16"] is not None and v["share_of_bf16"] >= share
                                           and v["bits_all_in"] <= max_bits for v in at)
        records.append(rec)
    head = ("| point | bits K / V (codes) | "
            + " | ".join(f"{n} tok: bits all-in / NIAH [95%] (share)" for n in lengths)
            + " | PPL none | logit NMSE none |\n|" + "---|" * (4 + len(lengths)) + "\n")
    body = ""
    for rec in records:
        cells = []
        for length in lengths:
            v = rec["lengths"].get(length)
            if v is None:
                cells.append("-")
                continue
            sh = "-" if v["share_of_bf16"] is None or rec["point"] == _bf16(rec["point"]) else f"{v['share_of_bf16']:.2f}"
            mark = "**" if v["frontier"] else ""
            cells.append(f"{v['bits_all_in']:.2f} / {mark}{stats.text(v['niah'])}{mark} ({sh})")
        ppl = f"{rec['ppl_none']:.2f}" if "ppl_none" in rec else "-"
        nmse = f"{rec['logit_nmse_none']:.4f}" if "logit_nmse_none" in rec else "-"
        bk, bv = rec["bits_codes"]
        body += f"| {rec['point']} | {bk:.3f} / {bv:.3f} | " + " | ".join(cells) + f" | {ppl} | {nmse} |\n"
    lines = []
    for o in orders:
        met = [rec for rec in records if rec["meets"] and rec["question"] == o]
        what = f"Target (>= {share:.0%} of bf16 at <= {max_bits} bits all-in at every length measured)"
        if len(orders) > 1:
            what += f", question {o}"
        if met:
            best = min(met, key=lambda rec: max(v["bits_all_in"] for v in rec["lengths"].values()))
            lines.append(f"{what}: met by {best['point']}.")
        else:
            lines.append(f"{what}: met by no point; bold: the frontier at each length.")
    return records, head + body, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pareto", description=__doc__.split("\n\n")[0])
    ap.add_argument("--retrieval", nargs="+", required=True, metavar="RUN_DIR", help="bench.retrieval run folders")
    ap.add_argument("--quality", metavar="RUN_DIR", help="a bench.quality perplexity run on the same artifacts")
    ap.add_argument("--share", type=float, default=0.9, help="target share of bf16's NIAH")
    ap.add_argument("--max-bits", type=float, default=1.6, help="target bits per element all-in")
    ap.add_argument("--out", help="folder for pareto.json and summary.md (default: print only)")
    a = ap.parse_args(argv)
    try:
        rows, config, arts = load_retrieval(a.retrieval)
        quality = load_quality(Path(a.quality), arts) if a.quality else {}
    except ValueError as e:
        print(f"bench.pareto: {e}", file=sys.stderr)
        return 2
    records, md, verdict = table(rows, quality, a.share, a.max_bits)
    text = (f"# NIAH against bits all-in, {config['model']}, {config['samples']} samples per task, "
            f"{config['model_dtype']} model\n\nRuns: " + ", ".join(f"`{d}`" for d in a.retrieval)
            + (f"; quality: `{a.quality}`" if a.quality else "") + f"\n\nIntervals: {stats.DESCRIPTION}, stratified "
            "by task. Bits all-in at each length's mean prompt: codes and scales + the windows' and kept tokens' "
            "copies (16-bit; for `:x8` points fp8 with a scale per token and head, 8.25 bits at d = 64; for `:r4` a 4-bit residual over the codes with a scale per token and head, 4.25).\n\n"
            + md + "\n" + verdict + "\n")
    print(text)
    if a.out:
        out = Path(a.out)
        write_json(out / "pareto.json", {"config": config, "runs": list(a.retrieval), "quality": a.quality,
                                         "share": a.share, "max_bits": a.max_bits,
                                         "artifacts": {k: v[0] for k, v in arts.items()},
                                         "points": [{**r, "lengths": {str(k): v for k, v in r["lengths"].items()}}
                                                    for r in records], "verdict": verdict})
        (out / "summary.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

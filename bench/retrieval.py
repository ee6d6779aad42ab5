"""Retrieval against bits (issue 14): RULER NIAH in the decode view for points of
(method, windows, salient tokens kept exact, where the question comes), each with its bits per
element all-in at the prompt length measured.

A point is written ``METHOD[:WINDOWS][:sB|:SB[/N[Ll]][aN][e|b]][:later|:first]``:

* ``METHOD``: any :mod:`bench.methods` name (``bf16``, ``tasq``, ``tasq@g4k64``, ``cq``, ...), layer
  mixes included (``tasq+tasq@g4k256/g8k1024@L3,7,12``: layers 3, 7, 12 at the 1.7 rate);
* ``WINDOWS``: ``none`` or ``SINK+RECENT`` (default ``64+256``; bf16 ignores it);
* ``sB``: keep ``B`` salient positions exact per (layer, KV head) (:mod:`sglang_tasq.salient`);
  ``SB``: one set of ``B`` positions per request, kept in every layer and head (the serving
  pool's unit: an exact-store entry holds a slot's every layer and head). Either way the
  positions are chosen from the attention of the last 32 queries before the question (``later``) or of the
  whole prompt's last 32 (default: the question is in the prompt, RULER's order); ``aN`` (``S64a12``)
  pools forward: a token is scored by the best peak up to N positions before it (a needle's value
  follows the words the question attends to), else by peaks within 3 positions either side; a
  final ``e`` (``S128a12e``) scores by the echo rule instead (:mod:`sglang_tasq.salient`: each
  prompt token's own attention to the prompt's head, above its running median), the selection
  for a question asked before the document; ``b`` (``S128a12b``) keeps half by each rule;
  ``SB/N[Ll]aMe`` (``S16/128L12a12e``): the streaming echo rule a server can run
  (:mod:`sglang_tasq.salient`, ``SalientSpec.block``): ``B`` of every ``N`` positions, each block
  decided from the prefix alone at layer ``l`` (default 0) and read exactly from it on; charged as
  ``B / N`` of every prompt token;
* ``later``: the prompt is read in two forwards, the context, then the question and the answer
  prefix; the selection sees only the context (the query-agnostic case: a question asked after
  the document, or in a later turn). Without salient tokens it equals the one-forward run.
* ``first``: the question comes before the haystack (:data:`bench.niah.TEMPLATE_FIRST`: the same
  needles, haystack and key; after the haystack only "Now answer the question asked before the
  text." and an answer prefix that does not name the key), the other query-agnostic case: the
  selection sees the question only through what the prompt's last tokens carry of it. Its share of
  bf16 is against ``bf16:first``, the same prompts; ``first - last`` pairs it with the same point on
  the question-last prompts (the same needles, haystacks and keys, sample by sample).
* ``x8``: the exact copies (windows and kept tokens) held as fp8 e4m3 with an fp16 scale per
  (token, KV head) (:func:`sglang_tasq.salient.fp8_rows`; keys pre-RoPE) instead of bf16: 8.25
  bits per element at d = 64 instead of 16 (served: ``calibrate serving --exact fp8``).
* ``r4``: each exact copy held as the token's own codes plus a 4-bit residual with an fp16 scale
  per (token, KV head) (:func:`sglang_tasq.salient.res4_rows`): 4.25 bits per element on top of
  the codes, which are counted as codes (served: ``calibrate serving --exact res4``).
* ``r2``: the same with a 2-bit residual (:func:`sglang_tasq.salient.res2_rows`: four Lloyd-Max
  levels of a Gaussian times the row's RMS): 2.25 bits per element on top of the codes. A
  decode-view measurement (not served).

Bits all-in, per element, averaged over keys and values at the measured mean prompt length T:
the codes' bits (scales included) + the windows' copies ``min(sink + recent, T) / T * 16`` (8.25
for ``x8``, 4.25 for ``r4``, 2.25 for ``r2``) + the kept tokens' copies and positions (:func:`sglang_tasq.salient.side_bits`).

Every (point, length) is one item JSON under the run folder, named by the model, preset, samples
and tasks (resumable; several processes may fill one folder with different points; an artifact
recalibrated since its items were made is refused, ``artifacts.json``). The summary pairs each point with a reference point
(``--ref``, default ``tasq:64+256``; a ``first`` point with the reference's ``first`` point) and with bf16
(``bf16:first`` for a ``first`` point) over the same samples (differences of
per-sample scores, bootstrap stratified by task)::

    python -m bench.retrieval --lengths 1024 --samples 8 \\
        --points bf16 tasq:64+256 tasq:64+256:s32 tasq:64+256:s32:later --artifact tasq=artifacts/smollm2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import methods as M
from . import niah, stats
from .report import write_json

RESULTS = Path(__file__).resolve().parent / "results" / "retrieval"
_POINT = re.compile(r"^(?P<m>[^:]+)(?::(?P<w>none|\d+\+\d+))?(?::(?P<kind>[sS])(?P<b>\d+)(?:/(?P<blk>\d+)(?:L(?P<lay>\d+))?)?(?:a(?P<a>\d+))?(?P<e>[eb])?)?"
                    r"(?::(?P<x>x8|r4|r2))?(?::(?P<q>later|first))?$")
_SIDES = {None: "bf16", "x8": "fp8", "r4": "res4", "r2": "res2"}  # point suffix -> how the exact copies are held


@dataclass(frozen=True)
class Point:
    method: str
    sink: int = 64
    recent: int = 256
    budget: int = 0
    later: bool = False
    shared: bool = False
    after: int | None = None
    first: bool = False
    rule: str = "obs"
    block: int | None = None
    layer: int = 0
    side: str = "bf16"  # how the exact copies (windows, kept tokens) are held: bf16, fp8 (":x8"), res4 (":r4"), res2 (":r2")

    @classmethod
    def parse(cls, text: str) -> "Point":
        m = _POINT.match(text)
        if not m:
            raise ValueError(f"point {text!r}: write METHOD[:none|SINK+RECENT][:sBUDGET|:SBUDGET[/BLOCK[Ll]][aN][e|b]][:x8|:r4|:r2][:later|:first], "
                             "e.g. tasq:64+256:s32")
        M.parse(m["m"])  # an unknown method fails here, with the allowed names
        sink, recent = M.parse_windows(m["w"] or "64+256")
        if m["m"] == "bf16":
            sink = recent = 0
        after = None if m["a"] is None else int(m["a"])
        point = cls(m["m"], sink, recent, int(m["b"] or 0), m["q"] == "later", m["kind"] == "S", after,
                    m["q"] == "first", {"e": "echo", "b": "both"}.get(m["e"], "obs"),
                    None if m["blk"] is None else int(m["blk"]), int(m["lay"] or 0), _SIDES[m["x"]])
        if point.block is not None:
            try:
                point.salient().check_windows(point.sink, point.recent)
            except ValueError as e:
                raise ValueError(f"point {text!r}: {e}") from None
        return point

    @property
    def question(self) -> str:
        """Where the prompt puts the question: "last" (RULER's order) or "first"."""
        return "first" if self.first else "last"

    @property
    def order_suffix(self) -> str:
        return ":later" if self.later else ":first" if self.first else ""

    @property
    def name(self) -> str:
        if self.method == "bf16":
            return "bf16" + self.order_suffix
        w = "none" if self.sink + self.recent == 0 else f"{self.sink}+{self.recent}"
        return f"{self.method}:{w}" + (f":{'S' if self.shared else 's'}{self.budget}" + (f"/{self.block}" + (f"L{self.layer}" if self.layer else "") if self.block else "") + (f"a{self.after}" if self.after is not None else "")
                + {"obs": "", "echo": "e", "both": "b"}[self.rule] if self.budget else "") \
            + {v: f":{k}" for k, v in _SIDES.items() if k}.get(self.side, "") + self.order_suffix

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)

    def salient(self):
        from sglang_tasq.salient import SalientSpec

        return SalientSpec(self.budget, shared=self.shared, after=self.after, rule=self.rule,
                           block=self.block, layer=self.layer) if self.budget else None

    def kept_tokens(self, T: float) -> float:
        """Kept tokens charged at a prompt of T: the budget, or ``budget / block`` of every token
        for a streaming point (an over-count: the sink and the undecided tail keep none)."""
        return self.budget * T / self.block if self.block else self.budget


def bits_all_in(point: Point, code_bits: tuple, T: float, head_dim: int) -> float:
    """Bits per element (mean of keys and values) at mean prompt length T, side buffers included."""
    from sglang_tasq.salient import side_bits, window_bits

    if point.method == "bf16":
        return 16.0
    extra = window_bits(point.sink, point.recent, T, point.side, head_dim) \
        + side_bits(point.kept_tokens(T), T, head_dim, point.side)
    return round((code_bits[0] + code_bits[1]) / 2 + extra, 3)


def question_split(tok, sample: dict) -> int:
    """Token index where the question (the input's last line) begins in the prompt."""
    question = sample["input"].rsplit("\n", 1)[1]
    at = sample["prompt"].rfind(question)
    if at < 0:
        raise ValueError(f"question {question[:40]!r}... not found in the prompt")
    offsets = tok(sample["prompt"], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return next(i for i, (a, _) in enumerate(offsets) if a >= at)


def evaluate(model, tok, method, point: Point, length: int, n: int, tasks=tuple(niah.TASKS),
             max_new=None) -> dict:
    """One item: {'tasks': {task: 0-100}, 'avg', 'preds', 'mean_length', 'seconds', ...}."""
    from .ruler import _samples, greedy, token_cap

    t0, scores, preds, lengths = time.time(), {}, [], []
    for task in tasks:
        outs = []
        for s in _samples(tok, task, length, n, point.question):
            split = question_split(tok, s) if point.later else None
            outs.append(greedy(model, tok, s["prompt"], method, point.sink, point.recent, s["outputs"],
                               token_cap(s, max_new), "decode", salient=point.salient(), split=split,
                               side=point.side))
            preds.append({"task": task, "index": s["index"], "length": s["length"], "gold": s["outputs"],
                          "pred": outs[-1]})
            lengths.append(s["length"])
        scores[task] = niah.string_match_all(outs, [p["gold"] for p in preds[-len(outs):]])
    return {"point": point.name, "length": length, "samples_per_task": n, "tasks": scores,
            "avg": sum(scores.values()) / len(scores), "mean_length": sum(lengths) / len(lengths),
            "preds": preds, "seconds": round(time.time() - t0, 1)}


def per_sample(item: dict) -> dict:
    """{(task, index): 0-100 score} of one item."""
    return {(p["task"], p["index"]): 100.0 * niah.sample_score(p["pred"], p["gold"]) for p in item["preds"]}


def _by_task(scores: dict) -> list:
    tasks: dict = {}
    for (task, _), v in sorted(scores.items()):
        tasks.setdefault(task, []).append(v)
    return list(tasks.values())


def paired(a: dict, b: dict) -> dict:
    """b - a over the samples both hold, as {mean, lo, hi, n} (bootstrap stratified by task)."""
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ValueError("no common samples to pair")
    diff = {k: b[k] - a[k] for k in keys}
    return vars(stats.stratified_interval(_by_task(diff)))


def summarize(items: dict, bits: dict, head_dim: int, ref: str) -> tuple[list, str]:
    """Rows (one per point and length) and the markdown table. items: {(point name, length): item}."""
    rows = []
    for (name, length), item in sorted(items.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        point, s = Point.parse(name), per_sample(item)
        row = {"point": name, "length": length, "n": len(s), "mean_length": round(item["mean_length"], 1),
               "bits_codes": bits[point.method],
               "bits_all_in": bits_all_in(point, bits[point.method], item["mean_length"], head_dim),
               "niah": vars(stats.stratified_interval(_by_task(s))), "tasks": item["tasks"]}
        same = ":first" if point.first else ""  # question-first points pair with question-first prompts
        base = items.get(("bf16" + same, length))
        if base is not None and name != "bf16" + same:
            row["vs_bf16"] = paired(per_sample(base), s)
            row["share_of_bf16"] = round(row["niah"]["mean"] / max(base["avg"], 1e-9), 3)
        r = items.get((ref + same, length))
        if r is not None and name != ref + same:
            row["vs_ref"] = paired(per_sample(r), s)
        last = items.get((name[:-len(":first")], length)) if point.first else None
        if last is not None:  # the same needles, haystack and key with the question last
            row["vs_last"] = paired(per_sample(last), s)
        rows.append(row)
    head = ("| length | point | bits K / V (codes) | bits all-in | NIAH [95%] | share of bf16 | - bf16 | - "
            f"{ref} | first - last |\n|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['length']} (mean {r['mean_length']:.0f}) | {r['point']} | {r['bits_codes'][0]:.3f} / {r['bits_codes'][1]:.3f} "
        f"| {r['bits_all_in']:.2f} | {stats.text(r['niah'])} | {r.get('share_of_bf16', '-')} "
        f"| {stats.text(r['vs_bf16']) if 'vs_bf16' in r else '-'} | {stats.text(r['vs_ref']) if 'vs_ref' in r else '-'} "
        f"| {stats.text(r['vs_last']) if 'vs_last' in r else '-'} |\n"
        for r in rows)
    return rows, head + body


def run_name(model: str, preset: str, n: int, tasks, max_new, dtype: str = "bfloat16") -> str:
    """The run folder of a workload; the model's compute dtype is part of it when not bf16 (a
    float32 run, on a CPU without bf16 matmuls, is not mixed with bf16 items)."""
    key = {"tasks": list(tasks), "max_new": max_new}
    if dtype != "bfloat16":
        key["dtype"] = dtype
    key = json.dumps(key, sort_keys=True)
    return f"{model}_{preset}_n{n}_{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def recorded_bits(run_dir: Path) -> dict:
    """{method: (bits per key, per value element)} from the run folder's last ``summary.json``."""
    path = run_dir / "summary.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    return {Point.parse(r["point"]).method: tuple(r["bits_codes"]) for r in rows}


def artifacts_here(spec, preset: str, root: Path, overrides: dict) -> bool:
    """Whether every artifact ``spec`` reads is on this machine (a closed-form method reads none)."""
    if isinstance(spec, M.MixSpec):
        if overrides and spec.mixed_artifact_name in overrides:
            return (Path(overrides[spec.mixed_artifact_name]) / "tasq.json").is_file()
        return all(artifacts_here(s, preset, root, overrides) for s in (spec.base, spec.hi))
    out = M.artifact_dir(spec, root, preset, overrides)
    return out is None or (out / "tasq.json").is_file()


def check_artifacts(run_dir: Path, ids: dict) -> None:
    """A run folder holds items of one artifact per name (``artifacts.json``: name -> its
    :func:`bench.methods.artifact_sha`); a recalibrated (or otherwise served) artifact is refused
    instead of mixing items of two fits."""
    path = run_dir / "artifacts.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    stale = {k: (M.short_id(old[k]), M.short_id(v)) for k, v in ids.items() if k in old and old[k] != v}
    if stale:
        raise ValueError(f"results in {run_dir} were computed with other artifacts (name: (then, now) artifact id: "
                         f"tensors sha256 [+ serving settings]) {stale}; pass --results DIR for a new run, or "
                         "delete the folder")
    write_json(path, {**old, **ids})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.retrieval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", required=True, help="METHOD[:WINDOWS][:sB|:SB[/N[Ll]][aN][e|b]][:later|:first] ... (see the module docstring)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--samples", type=int, default=8, help="per task (>= 8 for an interval worth reading)")
    ap.add_argument("--tasks", nargs="+", default=list(niah.TASKS))
    ap.add_argument("--max-new", type=int, default=None, help="generated-token cap (default RULER's 128)")
    ap.add_argument("--ref", default="tasq:64+256", help="the point every other is paired with")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--preset", default="default", choices=("default", "fast"))
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR",
                    help="artifact directory for an artifact name (e.g. tasq=artifacts/smollm2)")
    ap.add_argument("--artifact-root", default="artifacts/quality")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--report-only", action="store_true", help="summarize the items already in the run folder")
    a = ap.parse_args(argv)
    try:
        points = [Point.parse(p) for p in a.points]
        bad = [t for t in a.tasks if t not in niah.TASKS]
        if bad:
            raise ValueError(f"tasks {bad}: allowed {list(niah.TASKS)}")
        overrides = dict(kv.split("=", 1) for kv in a.artifact)
    except ValueError as e:
        print(f"bench.retrieval: {e}", file=sys.stderr)
        return 2

    import torch

    from sglang_tasq.models import dtype_name, fingerprint, load_config, resolve_model

    from .perplexity import load_model

    model, tok = load_model(a.model)
    H = model.config.num_key_value_heads
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    fp = fingerprint(load_config(resolve_model(a.model)))
    built, bits, ids = {}, {}, {}
    for name in dict.fromkeys(p.method for p in [*points, Point.parse(a.ref), Point.parse("bf16")]):
        built[name], arts = M.prepare(M.parse(name), a.model, a.preset, Path(a.artifact_root), overrides, fp)
        bits[name] = M.bits(built[name], H, d)
        for art_name, art in arts.items():
            ids[art_name] = M.artifact_sha(art)
    dtype = dtype_name(model.dtype)
    run_dir = Path(a.results) / run_name(a.model, a.preset, a.samples, a.tasks, a.max_new, dtype)
    try:
        check_artifacts(run_dir, ids)
    except ValueError as e:
        print(f"bench.retrieval: {e}", file=sys.stderr)
        return 2
    write_json(run_dir / "config.json", {"model": a.model, "preset": a.preset, "samples": a.samples,
                                         "tasks": a.tasks, "max_new": a.max_new,
                                         "torch_threads": torch.get_num_threads(), "model_dtype": dtype})
    items = {}
    for length in a.lengths:
        for p in points:
            path = run_dir / "items" / f"{p.slug}__{length}.json"
            if not path.is_file() and not a.report_only:
                print(f"[retrieval] {p.name} length={length} n={a.samples}", flush=True)
                item = evaluate(model, tok, built[p.method], p, length, a.samples, tuple(a.tasks), a.max_new)
                write_json(path, item)
                print(f"[retrieval] {p.name} length={length}: {item['avg']:.1f} in {item['seconds']:.0f} s", flush=True)
    recorded = recorded_bits(run_dir)
    for path in sorted((run_dir / "items").glob("*.json")):  # every point any process put here
        item = json.loads(path.read_text())
        items[(item["point"], item["length"])] = item
        if Point.parse(item["point"]).method not in bits:  # another process's point: its bits, its fit checked
            spec = M.parse(Point.parse(item["point"]).method)
            if spec.name in recorded and not artifacts_here(spec, a.preset, Path(a.artifact_root), overrides):
                bits[spec.name] = recorded[spec.name]
                print(f"[retrieval] {spec.name}: artifact not on this machine; its bits from the folder's summary.json "
                      "(its fit was checked into artifacts.json when its items were made)", flush=True)
                continue
            other, arts = M.prepare(spec, a.model, a.preset, Path(a.artifact_root), overrides, fp)
            bits[spec.name] = M.bits(other, H, d)
            try:
                check_artifacts(run_dir, {n: M.artifact_sha(art) for n, art in arts.items()})
            except ValueError as e:
                print(f"bench.retrieval: {e}", file=sys.stderr)
                return 2
    rows, md = summarize(items, bits, d, Point.parse(a.ref).name)
    write_json(run_dir / "summary.json", rows)
    (run_dir / "summary.md").write_text(
        f"# RULER NIAH against bits, {a.model}, decode view, {a.samples} samples per task\n\n"
        f"Intervals: {stats.DESCRIPTION}, stratified by task; differences paired per sample.\n\n" + md)
    print(md)
    print(f"[retrieval] run folder {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

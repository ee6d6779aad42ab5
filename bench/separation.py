"""Which headline metrics separate CQ at 0.5 bits/element from TaSQ at its reference rate.

The two methods: ``cq@g8k16`` (Coupled Quantization, 4-bit codes over 8 channels: 0.5
bits/element) and ``tasq`` (1.33 bits per key, 1.25 per value element). Per headline metric
and window setting, where the run measured both:

* per-window metrics on held-out Wikipedia (PPL, attention-logit NMSE and attention KL, both
  averaged over layers, next-token KL): the values of the evaluation windows both methods saw
  (``per_window`` of :func:`bench.perplexity.evaluate`; PPL as the window's mean NLL, i.e.
  log-PPL) are paired, window by window. The metric **separates** when the 95% paired-bootstrap
  interval of the mean difference tasq - cq@g8k16 (:func:`bench.stats.paired_interval`, the
  windows resampled) excludes 0: the difference exceeds the spread across windows. Both items
  come from the main comparison when both methods are in it, else from the rate sweep. Not
  judged: items made before per-window values were stored, or fewer than 2 windows.
* NIAH, per context length: separates when the two methods' 95% intervals of the mean over
  tasks (:func:`bench.report.niah_intervals`) do not overlap. Not judged: items that hold
  means only.

A metric that does not separate is listed as "does not separate (not a headline)".
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from . import stats

A, B = "cq@g8k16", "tasq"
MIN_WINDOWS = 2
# (label, item field of the value, per-window key)
PER_WINDOW = (("PPL wiki", "ppl", "nll"), ("attention-logit NMSE", "logit_nmse", "logit_nmse"),
              ("attention KL", "attn_kl", "attn_kl"), ("next-token KL", "token_kl", "token_kl"))
WORDS = {True: "separates", False: "does not separate (not a headline)", None: "not judged"}
RULE = (f"Rule: PPL (as per-window log-PPL), attention-logit NMSE, attention KL and next-token KL on held-out "
        f"wiki separate when the 95% paired-bootstrap interval of the mean per-window difference {B} - {A} "
        f"excludes 0 ({stats.RESAMPLES:,} resamples of the windows, seed {stats.SEED}); NIAH separates at a length "
        f"when the two methods' 95% intervals of the mean over tasks do not overlap.")


def _pair(wiki: dict, sweep: list, setting: str) -> Optional[tuple]:
    """(source, item of A, item of B) from the first source holding both, else None."""
    swept: dict = {}
    for r in sweep:
        swept.setdefault(r["method"], {})[r["windows"]] = r
    for source, by in (("main comparison", wiki), ("rate sweep", swept)):
        a, b = by.get(A, {}).get(setting), by.get(B, {}).get(setting)
        if a is not None and b is not None:
            return source, a, b
    return None


def _windowed(label: str, field: str, key: str, setting: str, pair: tuple) -> dict:
    source, a, b = pair
    out = {"metric": label, "windows": setting, "separates": None}
    head = f"{B} {b[field]:.4g} vs {A} {a[field]:.4g}, {source}"
    va, vb = ((x.get("per_window") or {}).get(key) for x in (a, b))
    if va is None or vb is None:
        return {**out, "value": f"{head}; no per-window values: items made before they were stored"}
    if len(va) != len(vb) or len(va) < MIN_WINDOWS:
        return {**out, "value": f"{head}; {len(va)} vs {len(vb)} windows: need the same number, at least {MIN_WINDOWS}"}
    d = stats.paired_interval(va, vb)
    what = "log-PPL" if key == "nll" else label
    return {**out, "separates": d.excludes(0.0), "difference": asdict(d),
            "value": f"{head}, {d.n} windows; per-window {what} difference {d.mean:+.4g} [{d.lo:+.4g}, {d.hi:+.4g}]"}


def _niah(rows: list, setting: str) -> list:
    ci = {r["method"]: r.get("niah_ci") or {} for r in rows if r["windows"] == setting}
    a, b = ci.get(A, {}), ci.get(B, {})
    out = []
    for length in sorted(set(a) & set(b), key=int):
        ia, ib = a[length]["all"], b[length]["all"]
        v = {"metric": f"NIAH {length}", "windows": setting, "separates": None, "intervals": {A: ia, B: ib},
             "value": f"{B} {stats.text(ib)} vs {A} {stats.text(ia)}"}
        if ia["lo"] is not None and ib["lo"] is not None:
            v["separates"] = not stats.Interval(**ia).overlaps(stats.Interval(**ib))
        out.append(v)
    return out


def verdicts(wiki: dict, sweep: list, rows: list, settings=("none", "64+256")) -> list:
    """One verdict per headline metric and window setting where both methods were measured.

    wiki: {method: {setting: perplexity item}} (the main comparison); sweep: rate-sweep rows;
    rows: summary rows with ``niah_ci``. Each verdict: {metric, windows, separates (True, False,
    or None: not judged), value (the numbers, or why not judged), difference | intervals}."""
    pairs = {s: _pair(wiki, sweep, s) for s in settings}
    out = [_windowed(label, field, key, s, pairs[s]) for label, field, key in PER_WINDOW
           for s in settings if pairs[s] is not None]
    return out + [v for s in settings for v in _niah(rows, s)]


def markdown(verdicts: list) -> list:
    """Markdown lines of the verdicts, with the rule."""
    lines = ["", f"## Does the metric separate CQ at 0.5 bits ({A}) from TaSQ ({B})?", "", RULE, ""]
    if not verdicts:
        return lines + [f"Not judged: {A} and {B} are not both in this run."]
    return lines + [f"- {v['metric']} (windows {v['windows']}): **{WORDS[v['separates']]}** ({v['value']})"
                    for v in verdicts]


REF = "tasq"


def against(wiki: dict, ref: str = REF, settings=("none", "64+256")) -> list:
    """Every other method of the main comparison paired with ``ref`` window by window: per
    setting and per-window metric, the 95% paired-bootstrap interval of the mean difference
    method - ref (log-PPL for PPL). Rows: {method, windows, metrics: {label: Interval dict}}; a
    metric is left out where either item lacks per-window values or the windows differ."""
    out = []
    for method in wiki:
        if method == ref:
            continue
        for s in settings:
            a, b = wiki.get(ref, {}).get(s), wiki[method].get(s)
            if a is None or b is None:
                continue
            got = {}
            for label, _, key in PER_WINDOW:
                va, vb = ((x.get("per_window") or {}).get(key) for x in (a, b))
                if va is None or vb is None or len(va) != len(vb) or len(va) < MIN_WINDOWS:
                    continue
                got[label] = asdict(stats.paired_interval(va, vb))
            if got:
                out.append({"method": method, "windows": s, "metrics": got})
    return out


def against_markdown(rows: list, ref: str = REF) -> list:
    """Markdown table of :func:`against` (empty when there is nothing to pair)."""
    if not rows:
        return []
    labels = [label for label, _, _ in PER_WINDOW]
    lines = ["", f"## Paired against {ref} (method - {ref}, per held-out window)", "",
             f"Mean difference [95% paired-bootstrap interval] over the same windows ({stats.RESAMPLES:,} resamples, "
             f"seed {stats.SEED}); PPL as log-PPL (nats/token). Negative: the method is closer to bf16 than {ref}.", "",
             "| method | windows | " + " | ".join(f"{x} diff" for x in labels) + " |", "|" + "---|" * (2 + len(labels))]
    for r in rows:
        cells = [_diff(r["metrics"][x]) if x in r["metrics"] else "-" for x in labels]
        lines.append(f"| {r['method']} | {r['windows']} | " + " | ".join(cells) + " |")
    return lines


def _diff(c: dict) -> str:
    return f"{c['mean']:+.3g} [{c['lo']:+.3g}, {c['hi']:+.3g}]"

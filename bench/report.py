"""Files out for the quality suite: cached item JSONs, the summary rows (NIAH with 95%
intervals), targets, the markdown report and PNG plots (rate vs PPL, per-layer NMSE, NIAH,
error by position)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

from . import separation, stats
from .methods import ABLATION_METHODS
from .niah import sample_score

SETTINGS = ("none", "64+256")
# summary-row field -> item field, for NIAH measured through a server (bench.ruler_server)
SERVER_ROW_FIELDS = (("niah_view", "view"), ("niah_served_windows", "windows"), ("niah_warm", "avg_warm"),
                     ("niah_warm_equal", "warm_equal_all"), ("niah_agree_decode", "agree_decode_all"))
MIN_SAMPLES = 2  # per task, for a NIAH interval


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def cached(path: Path, work):
    """The JSON at ``path`` if present (work already done), else ``work()`` written there."""
    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text())
    out = work()
    write_json(path, out)
    return out


def niah_intervals(item: dict) -> dict:
    """{"interval", "all", "tasks": {task: ...}} of one NIAH item: each a {mean, lo, hi, n} on
    the 0-100 scale, "all" the mean over tasks.

    Per-sample scores are recomputed from the item's predictions (:func:`bench.niah.sample_score`;
    server view: the cold pass): a percentile bootstrap per task, stratified by task for "all"
    (:mod:`bench.stats`). An item without predictions, or with fewer than ``MIN_SAMPLES`` per task
    (a bootstrap of one sample has no width), gives its means with lo = hi = None."""
    by_task: dict = {}
    for p in item.get("preds") or []:
        by_task.setdefault(p["task"], []).append(100.0 * sample_score(p["pred"], p["gold"]))
    if by_task and min(map(len, by_task.values())) >= MIN_SAMPLES:
        return {"interval": f"{stats.DESCRIPTION}; all tasks: stratified by task",
                "all": asdict(stats.stratified_interval(list(by_task.values()))),
                "tasks": {t: asdict(stats.mean_interval(v)) for t, v in by_task.items()}}
    n = {t: len(v) for t, v in by_task.items()} or dict.fromkeys(item["tasks"], item.get("samples_per_task"))
    why = f"fewer than {MIN_SAMPLES} samples per task" if by_task else "the item holds means only"
    return {"interval": f"none ({why})",
            "all": {"mean": item["avg"], "lo": None, "hi": None, "n": None if None in n.values() else sum(n.values())},
            "tasks": {t: {"mean": v, "lo": None, "hi": None, "n": n.get(t)} for t, v in item["tasks"].items()}}


def summary_rows(methods, bits: dict, ppl: dict, niah: dict) -> list:
    """One row per (method, window setting) with the headline metrics; ``niah_ci``: per length,
    :func:`niah_intervals`."""
    rows = []
    for name in methods:
        for s in SETTINGS:
            w = ppl.get("wiki", {}).get(name, {}).get(s, {})
            o = ppl.get("ood", {}).get(name, {}).get(s, {})
            n = niah.get(name, {}).get(s, {})
            rows.append({"method": name, "windows": s, "bits_k": bits[name][0], "bits_v": bits[name][1],
                         "ppl_wiki": w.get("ppl"), "ppl_ood": o.get("ppl"), "logit_nmse": w.get("logit_nmse"),
                         "attn_kl": w.get("attn_kl"), "token_kl": w.get("token_kl"),
                         "top1_agree": w.get("top1_agree"), "niah": {k: v["avg"] for k, v in n.items()},
                         "niah_ci": {k: niah_intervals(v) for k, v in n.items()}})
            if any(v.get("view") == "server" for v in n.values()):  # NIAH through a real server: both passes
                rows[-1].update({f: {k: v.get(key) for k, v in n.items()} for f, key in SERVER_ROW_FIELDS})
    return rows


def targets(rows: list) -> list:
    """The issue's targets, each with the numbers and whether it is met (None: not measured)."""
    by = {(r["method"], r["windows"]): r for r in rows}
    out = []

    def get(m, s, k):
        r = by.get((m, s))
        return None if r is None else r.get(k)

    for s in SETTINGS:
        b, c, t = (get(m, s, "ppl_wiki") for m in ("bf16", "cq", "tasq"))
        ok = None if None in (b, c, t) else (t - b) <= 0.5 * (c - b)
        out.append({"target": f"TaSQ PPL increase <= half of CQ's (windows {s})", "met": ok,
                    "value": None if ok is None else f"TaSQ {t - b:+.3f}, CQ {c - b:+.3f}"})
    b, t = get("bf16", "64+256", "ppl_wiki"), get("tasq", "64+256", "ppl_wiki")
    out.append({"target": "TaSQ PPL <= 1.10x bf16 with windows", "met": None if None in (b, t) else t <= 1.10 * b,
                "value": None if None in (b, t) else f"{t / b:.3f}x"})
    nb, nt = get("bf16", "64+256", "niah") or {}, get("tasq", "64+256", "niah") or {}
    common = sorted(set(nb) & set(nt), key=int)
    out.append({"target": "TaSQ NIAH with windows >= 95% of bf16 at every length",
                "met": None if not common else all(nt[k] >= 0.95 * nb[k] for k in common),
                "value": ", ".join(f"{k}: {nt[k]:.1f} vs {nb[k]:.1f}" for k in common) or None})
    for s in SETTINGS:
        t = get("tasq", s, "ppl_wiki")
        for m in sorted({r["method"] for r in rows if r["method"] in ABLATION_METHODS}):  # one component removed
            a = get(m, s, "ppl_wiki")
            out.append({"target": f"{m} worse than TaSQ (windows {s})", "met": None if None in (a, t) else a >= t,
                        "value": None if None in (a, t) else f"{a:.3f} vs {t:.3f}"})
    abl = {m: get(m, "none", "ppl_wiki") for m in ABLATION_METHODS}
    abl = {m: v for m, v in abl.items() if v is not None}
    t = get("tasq", "none", "ppl_wiki")
    if len(abl) >= 2 and "tasq_no_grouping" in abl and t is not None:  # the paper's Tab. 4 claim
        top = max(abl, key=abl.get)
        out.append({"target": "grouping is the largest single contributor (PPL, windows none)",
                    "met": top == "tasq_no_grouping",
                    "value": ", ".join(f"{m[5:]} {v - t:+.2f}" for m, v in sorted(abl.items(), key=lambda kv: -kv[1]))})
    return out



def _f(x, fmt="{:.3f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def niah_table(rows: list) -> list:
    """Markdown lines: NIAH per (method, windows, length), every task and all tasks as
    'mean [lo, hi]', with the samples per task; server view: each setting a server really
    applied (bf16 once)."""
    have = [r for r in rows if r.get("niah_ci")]
    tasks = sorted({t for r in have for c in r["niah_ci"].values() for t in c["tasks"]})
    kinds = sorted({c["interval"] for r in have for c in r["niah_ci"].values()})
    view = " (server view: the cold pass)" if any(r.get("niah_view") for r in have) else ""
    lines = ["", f"## NIAH by task{view} (string_match_all, 0-100): mean [95% interval]", "",
             "Interval: " + "; ".join(kinds) + ". n: samples per task.", "",
             "| method | windows | length | n | all | " + " | ".join(t.replace("niah_", "") for t in tasks) + " |",
             "|" + "---|" * (5 + len(tasks))]
    for r in have:
        for length, c in sorted(r["niah_ci"].items(), key=lambda kv: int(kv[0])):
            if r.get("niah_served_windows", {}).get(length, r["windows"]) != r["windows"]:
                continue
            ns = "/".join(sorted({"-" if v["n"] is None else str(v["n"]) for v in c["tasks"].values()}))
            cells = " | ".join(stats.text(c["tasks"][t]) if t in c["tasks"] else "-" for t in tasks)
            lines.append(f"| {r['method']} | {r['windows']} | {length} | {ns} | {stats.text(c['all'])} | {cells} |")
    return lines


def markdown(rows: list, tgts: list, ruler: dict, sweep: list, header: str, separates: list = (),
             paired: list = ()) -> str:
    lengths = sorted({k for r in rows for k in r["niah"]}, key=int)
    cols = ["method", "windows", "bits K", "bits V", "PPL wiki", "PPL code", "logit NMSE", "attn KL",
            "token KL", "top-1", *[f"NIAH {k}" for k in lengths]]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join([r["method"], r["windows"], _f(r["bits_k"]), _f(r["bits_v"]),
                                         _f(r["ppl_wiki"]), _f(r["ppl_ood"]), _f(r["logit_nmse"], "{:.4f}"),
                                         _f(r["attn_kl"], "{:.4f}"), _f(r["token_kl"], "{:.4f}"),
                                         _f(r["top1_agree"]), *[_f(r["niah"].get(k), "{:.1f}") for k in lengths]])
                     + " |")
    verdict = {True: "met", False: "not met", None: "not measured"}
    lines += ["", "## Targets", ""] + [f"- {t['target']}: **{verdict[t['met']]}**"
                                       + (f" ({t['value']})" if t["value"] else "") for t in tgts]
    lines += separation.markdown(separates)
    lines += separation.against_markdown(list(paired))
    if any(r.get("niah_ci") for r in rows):
        lines += niah_table(rows)
    if any(r.get("view") == "server" for m in ruler.values() for s in m.values() for r in s.values()):
        lines += server_table(ruler)
    if sweep:
        lines += ["", "## Rate sweep (held-out Wikipedia)", "",
                  "| method | windows | g | K | bits K | bits V | PPL | logit NMSE |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['windows']} | {r['g']} | {r['K']} | {_f(r['bits_k'])} | {_f(r['bits_v'])} | "
                  f"{_f(r['ppl'])} | {_f(r['logit_nmse'], '{:.4f}')} |" for r in sweep]
    return "\n".join(lines) + "\n"


def _count(r: dict, key: str) -> str:
    n = r.get(f"{key}_count")
    return "-" if n is None else f"{n}/{r['n_preds']}"


def server_table(ruler: dict) -> list:
    """Markdown lines: NIAH through the server, per task, cold and warm passes, each (method,
    served windows, length) once, with warm == cold and agreement with the decode view."""
    tasks = sorted({t for m in ruler.values() for s in m.values() for r in s.values() for t in r["tasks"]})
    lines = ["", "## NIAH through the server (string_match_all, 0-100)", "",
             "Cold: first pass; warm: every sample again, prompts in the radix cache (cached prompt tokens / "
             "prompt tokens in brackets). warm = cold: identical answers; = decode: the server's cold answer agrees "
             "with the decode view's (same text, or the decode view's early stop is a prefix of it).", "",
             "| method | windows | length | pass | " + " | ".join(t.replace("niah_", "") for t in tasks)
             + " | avg | warm = cold | = decode |", "|" + "---|" * (7 + len(tasks))]
    for m, by_s in ruler.items():
        for s, by_l in by_s.items():
            for length, r in by_l.items():
                if r.get("windows", s) != s:  # bf16 fills both settings: show the one it has
                    continue
                c = r.get("cached_tokens") or {}
                for p, key, avg in (("cold", "tasks", "avg"), ("warm", "tasks_warm", "avg_warm")):
                    hit = "" if c.get(p) is None else f" ({c[p] / max(1, c['prompt']):.2f})"
                    cells = " | ".join(_f(r[key].get(t), "{:.0f}") for t in tasks)
                    tail = f"{_count(r, 'warm_equal')} | {_count(r, 'agree_decode')}" if p == "cold" else " | "
                    lines.append(f"| {m} | {s} | {length} | {p}{hit} | {cells} | {_f(r[avg], '{:.1f}')} | {tail} |")
    return lines


def plots(out: Path, ppl: dict, ruler: dict, positions: dict, sweep: list, bf16_ppl=None, calib_len: int = 2048) -> list:
    """PNG files written under ``out``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for base in sorted({r["base"] for r in sweep}):
            for s, ls in zip(SETTINGS, ("--", "-")):
                pts = sorted(((r["bits_k"] + r["bits_v"]) / 2, r["ppl"]) for r in sweep
                             if r["base"] == base and r["windows"] == s)
                if pts:
                    ax.plot(*zip(*pts), ls, marker="o", label=f"{base} ({s})")
        if bf16_ppl:
            ax.axhline(bf16_ppl, color="k", lw=0.8, label="bf16")
        ax.set(xlabel="bits / element (mean of K, V)", ylabel="PPL (held-out wiki)", yscale="log",
               title="Rate vs perplexity")
        ax.legend(fontsize=7)
        save(fig, "rate_vs_ppl.png")
    wiki = ppl.get("wiki", {})
    if wiki:
        fig, ax = plt.subplots(figsize=(7, 4))
        for m, by_s in wiki.items():
            ln = by_s.get("none", {}).get("layer_nmse")
            if ln and m != "bf16":
                ax.plot(range(len(ln)), ln, marker=".", label=m)
        ax.set(xlabel="layer", ylabel="attention-logit NMSE (windows none)", yscale="log", title="Per-layer logit NMSE")
        ax.legend(fontsize=6, ncol=2)
        save(fig, "layer_nmse.png")
    if ruler:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m, by_s in ruler.items():
            for s, ls in zip(SETTINGS, ("--", "-")):
                r = by_s.get(s)
                if r:
                    ks = sorted(r, key=int)
                    axes[0].plot([int(k) for k in ks], [r[k]["avg"] for k in ks], ls, marker="o", label=f"{m} ({s})")
        axes[0].set(xscale="log", xlabel="context length", ylabel="NIAH avg (8 tasks)", title="NIAH by length")
        axes[0].legend(fontsize=6)
        names = [(m, s) for m, by_s in ruler.items() for s in by_s]
        tasks = sorted({t for m, s in names for r in ruler[m][s].values() for t in r["tasks"]})
        w = 0.8 / max(1, len(names))
        for i, (m, s) in enumerate(names):
            vals = [sum(r["tasks"][t] for r in ruler[m][s].values()) / len(ruler[m][s]) for t in tasks]
            axes[1].bar([j + i * w for j in range(len(tasks))], vals, w, label=f"{m} ({s})")
        axes[1].set_xticks([j + 0.4 for j in range(len(tasks))], [t.replace("niah_", "") for t in tasks],
                           rotation=30, fontsize=7)
        axes[1].set(ylabel="score (mean over lengths)", title="NIAH by task")
        save(fig, "niah.png")
    if positions:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m, by_s in positions.items():
            if m == "bf16":
                continue
            for s, ls in zip(SETTINGS, ("--", "-")):
                r = by_s.get(s)
                if r:
                    for ax, y in zip(axes, (r["token_kl_by_pos"], r["bucket_nmse"])):
                        ax.plot([r["bucket"] * (i + 0.5) for i in range(len(y))], y, ls, label=f"{m} ({s})")
        for ax, y in zip(axes, ("next-token KL vs bf16", "attention-logit NMSE (mean over layers)")):
            ax.axvline(calib_len, color="k", lw=0.8)
            ax.set(xlabel="position", ylabel=y, yscale="log", title=f"Error by position (calibrated at {calib_len})")
        axes[0].legend(fontsize=6)
        save(fig, "error_by_position.png")
    return made

"""The quality summary's uncertainty: NIAH intervals from item JSONs (old ones included), the
"separates CQ@0.5 from TaSQ" verdicts on synthetic items, and the ``--ppl-len`` option."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import quality as Q
from bench import report, separation
from bench.separation import A, B

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality"
BITS = {A: (0.5, 0.5), B: (1.3333, 1.25)}


def _ppl_item(nll: list, attn_kl: list, per_window: bool = True) -> dict:
    item = {"ppl": 2.718 ** (sum(nll) / len(nll)), "logit_nmse": 0.01, "attn_kl": sum(attn_kl) / len(attn_kl),
            "token_kl": 0.1}
    if per_window:
        item["per_window"] = {"nll": nll, "attn_kl": attn_kl, "token_kl": [0.1] * len(nll),
                              "logit_nmse": [0.01] * len(nll)}
    return item


def _niah_item(hits: dict) -> dict:
    """hits: {task: [found?] per sample}, one gold string each."""
    preds = [{"task": t, "gold": ["1234567"], "pred": " 1234567." if h else " none"} for t, hs in hits.items()
             for h in hs]
    tasks = {t: 100.0 * sum(hs) / len(hs) for t, hs in hits.items()}
    return {"tasks": tasks, "avg": sum(tasks.values()) / len(tasks), "samples_per_task": 4, "preds": preds}


def _run():
    """(wiki items, summary rows) of a synthetic run with both methods."""
    cq_nll = [3.5, 3.0, 4.0, 3.2]
    wiki = {A: {"none": _ppl_item(cq_nll, [0.1, 0.2, 0.3, 0.4], per_window=False),
                "64+256": _ppl_item(cq_nll, [0.1, 0.2, 0.3, 0.4])},
            B: {"none": _ppl_item([x - 0.3 for x in cq_nll], [0.2, 0.1, 0.4, 0.3], per_window=False),
                "64+256": _ppl_item([x - 0.3 for x in cq_nll], [0.2, 0.1, 0.4, 0.3])}}
    miss, hit, mixed = ([False] * 4, [True] * 4, [True, False, True, False])
    means_only = {"1024": {"tasks": {"niah_single_1": 25.0}, "avg": 25.0}}
    nia = {A: {"64+256": {"1024": _niah_item({"niah_single_1": miss, "niah_single_2": miss}),
                          "2048": _niah_item({"niah_single_1": mixed, "niah_single_2": hit})}, "none": means_only},
           B: {"64+256": {"1024": _niah_item({"niah_single_1": hit, "niah_single_2": hit}),
                          "2048": _niah_item({"niah_single_1": mixed, "niah_single_2": hit})}, "none": means_only}}
    return wiki, report.summary_rows([A, B], BITS, {"wiki": wiki}, nia)


def test_niah_intervals_in_summary_rows():
    _, rows = _run()
    row = next(r for r in rows if (r["method"], r["windows"]) == (B, "64+256"))
    c = row["niah_ci"]["2048"]
    assert row["niah"]["2048"] == c["all"]["mean"] == 75.0 and c["all"]["n"] == 8
    assert c["tasks"]["niah_single_2"] == {"mean": 100.0, "lo": 100.0, "hi": 100.0, "n": 4}
    assert c["all"]["lo"] < 75.0 < c["all"]["hi"] and "percentile bootstrap" in c["interval"]
    old = next(r for r in rows if (r["method"], r["windows"]) == (A, "none"))["niah_ci"]["1024"]
    assert old["all"] == {"mean": 25.0, "lo": None, "hi": None, "n": None} and "means only" in old["interval"]
    md = report.markdown(rows, report.targets(rows), {}, [], "# t")
    assert f"| {B} | 64+256 | 2048 | 4 | 75.0 [" in md and "25.0 (mean only)" in md


def test_separation_verdicts():
    wiki, rows = _run()
    v = {(x["metric"], x["windows"]): x for x in separation.verdicts(wiki, [], rows)}
    assert v[("PPL wiki", "64+256")]["separates"] is True  # every window 0.3 lower in log-PPL
    assert v[("PPL wiki", "64+256")]["difference"]["mean"] == pytest.approx(-0.3)
    assert v[("attention KL", "64+256")]["separates"] is False  # +-0.1 by window: within the spread
    assert v[("next-token KL", "64+256")]["separates"] is False  # identical
    assert v[("PPL wiki", "none")]["separates"] is None and "no per-window values" in v[("PPL wiki", "none")]["value"]
    assert v[("NIAH 1024", "64+256")]["separates"] is True  # [0, 0] vs [100, 100]
    assert v[("NIAH 2048", "64+256")]["separates"] is False  # the same scores
    assert v[("NIAH 1024", "none")]["separates"] is None  # means only
    md = "\n".join(separation.markdown(list(v.values())))
    assert "- PPL wiki (windows 64+256): **separates**" in md
    assert "- attention KL (windows 64+256): **does not separate (not a headline)**" in md
    assert "- NIAH 1024 (windows none): **not judged**" in md and "Rule:" in md


def test_separation_sources():
    wiki, rows = _run()
    sweep = [{"method": m, "windows": s, **item} for m, by_s in wiki.items() for s, item in by_s.items()]
    from_sweep = separation.verdicts({"bf16": {}}, sweep, [])
    assert len(from_sweep) == 8 and all("rate sweep" in x["value"] for x in from_sweep)
    short = {m: {"64+256": {**by_s["64+256"], "per_window": {"nll": [3.0]}}} for m, by_s in wiki.items()}
    one = separation.verdicts(short, [], [])[0]
    assert one["separates"] is None and "1 vs 1 windows" in one["value"]
    assert separation.verdicts({B: wiki[B]}, [], [r for r in rows if r["method"] == B]) == []
    assert "not both in this run" in separation.markdown([])[-1]


def test_stored_niah_items_still_load():
    """Items written before the intervals: per-sample scores come back from their predictions."""
    item = RESULTS / "smollm2-135m_full_default_b5793359" / "items" / "ruler" / "tasq__64+256__1024.json"
    old = json.loads(item.read_text())
    c = report.niah_intervals(old)
    assert c["all"]["mean"] == pytest.approx(old["avg"]) and c["all"]["n"] == 64
    assert c["all"]["lo"] < c["all"]["mean"] < c["all"]["hi"]
    assert {t: x["mean"] for t, x in c["tasks"].items()} == pytest.approx(old["tasks"])
    assert all(x["n"] == 8 for x in c["tasks"].values())
    one = json.loads((RESULTS / "smollm2-135m_full_default_c95e7786" / "items" / "ruler" / "tasq__64+256__8192.json")
                     .read_text())  # 1 sample per task: no interval
    c1 = report.niah_intervals(one)
    assert c1["all"]["lo"] is None and c1["all"]["n"] == 8 and "fewer than 2" in c1["interval"]


def test_ppl_len_option(smollm2_dir, tmp_path):
    from transformers import AutoConfig

    cfg, _ = Q.parse_args(["--benches", "perplexity", "--ppl-len", "8192", "--methods", "bf16"])
    assert cfg.ppl_len == 8192 and Q.parse_args([])[0].ppl_len == 2048
    assert cfg.name() != Q.parse_args(["--benches", "perplexity", "--methods", "bf16"])[0].name()
    smol = SimpleNamespace(config=AutoConfig.from_pretrained(smollm2_dir))  # 8192 positions
    assert Q.build_context(cfg, tmp_path, model=smol).cfg.ppl_len == 8192
    with pytest.raises(ValueError, match="ppl_len 8193: model smollm2-135m has 8192 positions"):
        Q.build_context(Q.parse_args(["--benches", "perplexity", "--ppl-len", "8193", "--methods", "bf16"])[0],
                        tmp_path, model=smol)


def test_every_method_is_paired_against_tasq():
    from bench import separation

    def item(vals):
        return {"ppl": 1.0, "per_window": {"nll": vals, "logit_nmse": vals, "attn_kl": vals, "token_kl": vals}}

    wiki = {"tasq": {"none": item([1.0, 2.0, 3.0])}, "cq": {"none": item([1.5, 2.5, 3.5]), "64+256": item([1.0, 2.0])},
            "old": {"none": {"ppl": 2.0}}}
    rows = separation.against(wiki)
    assert [(r["method"], r["windows"]) for r in rows] == [("cq", "none")]  # no tasq at 64+256; no per-window values
    d = rows[0]["metrics"]["PPL wiki"]
    assert (d["mean"], d["lo"], d["hi"]) == pytest.approx((0.5, 0.5, 0.5))  # method - tasq
    md = "\n".join(separation.against_markdown(rows))
    assert "Paired against tasq" in md and "| cq | none | +0.5 [+0.5, +0.5]" in md
    assert separation.against_markdown([]) == []

"""The quality suite's NIAH "server" view without a server: which methods a server runs (and the
one-line refusal of the others), the launch line, the run name, answer agreement with the decode
view, both passes' scores and the report's table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import quality as Q
from bench import report, ruler_server as RS


def test_server_kind_and_refusal():
    assert RS.server_kind("bf16") == "bf16"
    for name in ("tasq", "tasq@g8k1024", "tasq@g8k256", "tasq@g4k256/g8k512", "tasq_tp3"):  # TaSQ at any rate
        assert RS.server_kind(name) == "tasq", name
    for name in ("fp8_e4m3", "kivi2", "cq", "cq@g4k256", "tasq_no_grouping", "tasq_keys_only", "tasq_values_only"):
        assert RS.server_kind(name) is None, name
        with pytest.raises(ValueError) as e:
            RS.check_servable(["bf16", name])
        assert f"'{name}'" in str(e.value) and "\n" not in str(e.value)
    RS.check_servable(["bf16", "tasq"])


def test_config_refuses_unservable_methods_one_line(capsys):
    with pytest.raises(ValueError, match="'cq' cannot be served"):
        Q.QualityConfig(methods=("bf16", "cq"), benches=("ruler",), niah_view="server", niah_methods=("bf16", "cq"))
    # cq measured by other benches but not by NIAH: fine
    Q.QualityConfig(methods=("bf16", "cq", "tasq"), benches=("ruler",), niah_view="server",
                    niah_methods=("bf16", "tasq"))
    with pytest.raises(SystemExit) as e:
        Q.parse_args(["--benches", "ruler", "--niah-view", "server", "--methods", "bf16,kivi2", "--niah-methods", ""])
    msg = str(e.value)
    assert "'kivi2'" in msg and "\n" not in msg
    with pytest.raises(SystemExit):  # the old view is gone from the CLI
        Q.parse_args(["--niah-view", "serving"])


def test_run_name_changes_with_the_view_only(monkeypatch):
    # the names of bf16-model runs (a float32 model, on a CPU without bf16 matmuls, names its own)
    monkeypatch.setenv("SGLANG_TASQ_DTYPE", "bfloat16")
    argv = ["--benches", "ruler", "--methods", "bf16,tasq", "--niah-methods", "bf16,tasq", "--niah-lengths", "1024"]
    dec, _ = Q.parse_args(argv)
    srv, _ = Q.parse_args(argv + ["--niah-view", "server"])
    assert dec.niah_view == "decode" and srv.niah_view == "server"
    assert srv.name() != dec.name() and RS.decode_twin(srv) == dec.name()
    # decode-view names are those of the code before the server view (old run folders stay valid)
    assert dec.name() == "smollm2-135m_full_default_b5793359"  # the committed 8-sample decode run
    # the full default run: all methods (cq_pairs added with issue 13; nsnquant, nsnquant2, novakv,
    # novakv1 with issue 15) and 8 NIAH samples per task (the NIAH and positions lists name theirs)
    assert Q.QualityConfig().name() == "smollm2-135m_full_default_eb8dfcdf"


def test_server_command(tmp_path):
    m = tmp_path / "tasq.json"
    m.write_text(json.dumps({"windows": {"sink": 64, "recent": 256}}))
    cmd = RS.server_command("tasq", tmp_path, 1234, m)
    assert "--disable-radix-cache" not in cmd and cmd[cmd.index("--tasq-config") + 1] == str(m)
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == "256" and cmd[cmd.index("--max-running-requests") + 1] == "4"
    assert "--enable-cache-report" in cmd and "--disable-cuda-graph" in cmd
    bf = RS.server_command("bf16", tmp_path, 1234)
    assert "--tasq-config" not in bf and "--disable-radix-cache" not in bf
    assert RS.served_windows("tasq", m) == "64+256" and RS.served_windows("bf16") == "none"


def test_same_answer():
    gold = ["1234567"]
    assert RS.same_answer(" 1234567.", "1234567.", gold)  # surrounding whitespace only
    assert RS.same_answer(" 1234567", " 1234567. And more text", gold)  # decode view stopped once the gold was out
    assert not RS.same_answer(" 12", " 1234567", gold)  # a prefix, but the decode view did not stop early
    assert not RS.same_answer("", " 1234567", gold)
    assert not RS.same_answer(" 7654321", " 1234567", gold)
    assert RS.same_answer("", "", gold)
    assert not RS.same_answer(" 1234567 and", " 1234567 or", gold)


def _samples():
    return [{"task": t, "index": i, "length": 100 + i, "outputs": [g]}
            for t, g in (("niah_single_1", "111"), ("niah_multikey_2", "222")) for i in range(2)]


def _ans(texts, cached=0):
    return [{"text": t, "prompt_tokens": 100 + i % 2, "completion_tokens": 5, "cached_tokens": cached}
            for i, t in enumerate(texts)]


def _item():
    s = RS.summarize(_samples(), _ans(["111", "x", "222", "222"]), _ans(["111", "y", "222", "no"], cached=90))
    return {**s, "samples_per_task": 2, "view": "server", "windows": "64+256", "length": 1024}


def test_summarize_both_passes():
    it = _item()
    assert it["tasks"] == {"niah_single_1": 50.0, "niah_multikey_2": 100.0} and it["avg"] == 75.0
    assert it["tasks_warm"] == {"niah_single_1": 50.0, "niah_multikey_2": 50.0} and it["avg_warm"] == 50.0
    assert it["warm_equal"] == {"niah_single_1": 0.5, "niah_multikey_2": 0.5}
    assert (it["warm_equal_count"], it["n_preds"], it["warm_equal_all"]) == (2, 4, 0.5)
    assert it["cached_tokens"] == {"prompt": 402, "cold": 0, "warm": 360} and it["prompt_tokens_match"] == 4
    assert [p["pred_warm"] for p in it["preds"]] == ["111", "y", "222", "no"]
    with pytest.raises(ValueError):
        RS.summarize(_samples(), _ans(["a"]), _ans(["a"]))


def test_agreement_with_the_decode_view():
    it = _item()
    dec = {"samples_per_task": 2, "preds": [{"task": s["task"], "index": s["index"], "gold": s["outputs"], "pred": p}
                                            for s, p in zip(_samples(), ["111", "z", "22", "222"])]}
    a = RS.agreement(it, dec, "run_x")
    assert a["agree_decode"] == {"niah_single_1": 0.5, "niah_multikey_2": 0.5} and a["agree_decode_count"] == 2
    # same per-sample score: "x" vs "z" (both 0) agrees on the score, "222" vs "22" does not
    assert a["agree_score"] == {"niah_single_1": 1.0, "niah_multikey_2": 0.5} and a["agree_score_all"] == 0.75
    assert a["decode_run"] == "run_x"
    recs = RS.with_decode_preds({**it, **a}, dec)
    assert [r["agrees_decode"] for r in recs] == [True, False, False, True] and recs[1]["decode_pred"] == "z"
    assert all(v is None for v in RS.agreement(it, None).values())
    assert all(v is None for v in RS.agreement(it, {**dec, "samples_per_task": 3}).values())
    other = {**dec, "preds": [{**p, "gold": ["999"]} for p in dec["preds"]]}  # different samples
    assert all(v is None for v in RS.agreement(it, other).values())
    assert all(r["decode_pred"] is None for r in RS.with_decode_preds(it, None))


def test_report_shows_the_server_view():
    it = {**_item(), **RS.agreement(_item(), None)}
    bf = {**it, "windows": "none"}
    nia = {"bf16": {"none": {"1024": bf}, "64+256": {"1024": bf}}, "tasq": {"64+256": {"1024": it}}}
    bits = {"bf16": (16.0, 16.0), "tasq": (1.333, 1.25)}
    rows = report.summary_rows(list(bits), bits, {}, nia)
    tq = next(r for r in rows if r["method"] == "tasq" and r["windows"] == "64+256")
    assert tq["niah"] == {"1024": 75.0} and tq["niah_warm"] == {"1024": 50.0} and tq["niah_warm_equal"] == {"1024": 0.5}
    assert tq["niah_view"] == {"1024": "server"} and tq["niah_agree_decode"] == {"1024": None}
    assert next(r for r in rows if r["method"] == "tasq" and r["windows"] == "none")["niah"] == {}
    md = report.markdown(rows, report.targets(rows), nia, [], "# t")
    assert "## NIAH through the server" in md and "## NIAH by task (server view: the cold pass)" in md
    assert "| tasq | 64+256 | 1024 | cold (0.00) | 100 | 50 | 75.0 | 2/4 | - |" in md
    assert "| tasq | 64+256 | 1024 | warm (0.90) | 50 | 50 | 50.0 |  |  |" in md
    # two summary rows, one interval row, one cold + one warm row (not one per setting)
    assert md.count("| bf16 |") == 2 + 1 + 2
    json.dumps(rows)


def test_files_stay_small():
    root = Path(__file__).resolve().parents[2]
    for f in ("bench/ruler.py", "bench/ruler_server.py", "bench/quality.py", "bench/report.py"):
        assert len((root / f).read_text().splitlines()) < 400, f

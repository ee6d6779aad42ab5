"""bench.pareto: the frontier keeps exactly the undominated points, the target verdict follows
the share and bits at every measured length, and run folders of other samples or other fits are
refused instead of joined."""
import json

import pytest

from bench import pareto

WORKLOAD = {"model": "m", "preset": "default", "samples": 8, "tasks": ["a", "b"], "max_new": None,
            "model_dtype": "bfloat16", "torch_threads": 2}


def _row(point, length, niah, bits_all_in, codes=(1.333, 1.25)):
    return {"point": point, "length": length, "n": 16, "mean_length": length * 0.9, "bits_codes": list(codes),
            "bits_all_in": bits_all_in, "niah": {"mean": niah, "lo": niah - 5, "hi": niah + 5, "n": 16},
            "tasks": {}}


def _run(tmp_path, name, rows, artifacts=None, **config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**WORKLOAD, **config}))
    (d / "summary.json").write_text(json.dumps(rows))
    (d / "artifacts.json").write_text(json.dumps(artifacts or {"tasq": "aa" * 32}))
    return d


def test_frontier_keeps_the_undominated_points_only():
    pts = {"bf16": (16.0, 70.0), "cheap": (2.0, 40.0), "mid": (4.0, 55.0), "worse_mid": (4.5, 50.0),
           "same_score_more_bits": (3.0, 40.0), "tie": (4.0, 55.0)}
    assert pareto.frontier(pts) == {"bf16", "cheap", "mid", "tie"}


def test_verdict_names_the_cheapest_point_meeting_the_target_at_every_length(tmp_path):
    one = _run(tmp_path, "1k", [_row("bf16", 1024, 80, 16), _row("a", 1024, 76, 1.5), _row("b", 1024, 78, 1.2),
                               _row("c", 1024, 40, 1.0)])
    two = _run(tmp_path, "2k", [_row("bf16", 2048, 60, 16), _row("a", 2048, 57, 1.4), _row("b", 2048, 50, 1.1)])
    rows, _, _ = pareto.load_retrieval([one, two])
    records, md, verdict = pareto.table(rows, {}, share=0.9, max_bits=1.6)
    by = {r["point"]: r for r in records}
    assert by["a"]["meets"] and not by["b"]["meets"]  # b: 50 / 60 = 0.83 at 2k
    assert by["a"]["lengths"][2048]["share_of_bf16"] == pytest.approx(0.95)
    assert not by["bf16"]["meets"]
    assert verdict.endswith("met by a.")
    assert by["b"]["lengths"][1024]["frontier"] and not by["a"]["lengths"][1024]["frontier"]  # b: more NIAH, fewer bits
    assert "| c |" in md and md.count("\n") == 2 + 4
    # a bits ceiling below a's bits: no point meets it
    _, _, verdict = pareto.table(rows, {}, share=0.9, max_bits=1.45)
    assert "met by no point" in verdict


def test_quality_columns_join_by_method_and_check_the_artifacts(tmp_path):
    run = _run(tmp_path, "1k", [_row("bf16", 1024, 80, 16), _row("tasq:64+256", 1024, 50, 7.0)])
    q = tmp_path / "quality"
    q.mkdir()
    (q / "summary.json").write_text(json.dumps([
        {"method": "tasq", "windows": "none", "ppl_wiki": 25.0, "logit_nmse": 0.007},
        {"method": "tasq", "windows": "64+256", "ppl_wiki": 18.5, "logit_nmse": 0.005}]))
    (q / "artifacts.json").write_text(json.dumps({"tasq": "aa" * 32}))
    rows, _, arts = pareto.load_retrieval([run])
    records, md, _ = pareto.table(rows, pareto.load_quality(q, arts), 0.9, 1.6)
    tasq = next(r for r in records if r["point"] == "tasq:64+256")
    assert (tasq["ppl_none"], tasq["logit_nmse_none"]) == (25.0, 0.007)
    assert "| 25.00 | 0.0070 |" in md
    (q / "artifacts.json").write_text(json.dumps({"tasq": "bb" * 32}))
    with pytest.raises(ValueError, match="artifact 'tasq' differs"):
        pareto.load_quality(q, pareto.load_retrieval([run])[2])


def test_runs_of_other_samples_fits_or_results_are_refused(tmp_path, capsys):
    one = _run(tmp_path, "one", [_row("bf16", 1024, 80, 16)])
    other_samples = _run(tmp_path, "n4", [_row("bf16", 2048, 60, 16)], samples=4)
    with pytest.raises(ValueError, match="another workload.*samples"):
        pareto.load_retrieval([one, other_samples])
    other_fit = _run(tmp_path, "fit2", [_row("bf16", 2048, 60, 16)], artifacts={"tasq": "cc" * 32})
    with pytest.raises(ValueError, match="different fits"):
        pareto.load_retrieval([one, other_fit])
    clash = _run(tmp_path, "clash", [_row("bf16", 1024, 75, 16)])
    with pytest.raises(ValueError, match="differs between run folders"):
        pareto.load_retrieval([one, clash])
    same = _run(tmp_path, "copy", [_row("bf16", 1024, 80, 16)])  # the same item copied: joined once
    assert len(pareto.load_retrieval([one, same])[0]) == 1
    # a run folder from before model_dtype was recorded reads as bf16 (run_name's convention)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({k: v for k, v in WORKLOAD.items() if k != "model_dtype"}))
    (old / "summary.json").write_text(json.dumps([_row("bf16", 4096, 50, 16)]))
    assert len(pareto.load_retrieval([one, old])[0]) == 2
    assert pareto.main(["--retrieval", str(one), str(other_samples)]) == 2
    assert "another workload" in capsys.readouterr().err
    out = tmp_path / "out"
    assert pareto.main(["--retrieval", str(one), str(old), "--out", str(out)]) == 0
    saved = json.loads((out / "pareto.json").read_text())
    assert [p["point"] for p in saved["points"]] == ["bf16"] and set(saved["points"][0]["lengths"]) == {"1024", "4096"}
    assert (out / "summary.md").read_text().startswith("# NIAH against bits all-in, m,")


def test_question_first_points_are_judged_against_their_own_prompts(tmp_path):
    run = _run(tmp_path, "1k", [_row("bf16", 1024, 80, 16), _row("a", 1024, 40, 1.5), _row("bf16:first", 1024, 40, 16),
                                _row("a:first", 1024, 38, 1.5), _row("b:first", 1024, 20, 1.2)])
    rows, _, _ = pareto.load_retrieval([run])
    records, md, verdict = pareto.table(rows, {}, share=0.9, max_bits=1.6)
    by = {r["point"]: r for r in records}
    assert by["a:first"]["lengths"][1024]["share_of_bf16"] == pytest.approx(0.95)  # of bf16:first, not bf16
    assert by["a:first"]["meets"] and not by["a"]["meets"] and not by["bf16:first"]["meets"]
    # each order has its own frontier: a (1.5 bits, 40) is not dominated by a:first or b:first
    assert by["a"]["lengths"][1024]["frontier"] and by["b:first"]["lengths"][1024]["frontier"]
    assert verdict.splitlines() == [
        "Target (>= 90% of bf16 at <= 1.6 bits all-in at every length measured), question last: met by no point; "
        "bold: the frontier at each length.",
        "Target (>= 90% of bf16 at <= 1.6 bits all-in at every length measured), question first: met by a:first."]
    assert [r["point"] for r in records] == ["bf16", "a", "bf16:first", "b:first", "a:first"]

"""``bench.compare_runs``: one point of two retrieval run folders, paired sample by sample, and
refused when the folders do not hold the same samples."""
import json

import pytest

from bench import compare_runs as cr

CONFIG = {"model": "smollm2-135m", "preset": "default", "samples": 2, "tasks": ["niah_single_1", "niah_multikey_1"],
          "max_new": None, "model_dtype": "bfloat16"}


def _run(tmp_path, name, hits, config=CONFIG, gold="7", point="tasq:64+256"):
    """A run folder whose ``point`` item at 1024 answers sample i right where hits[i]."""
    from bench.retrieval import Point

    run = tmp_path / name
    (run / "items").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    (run / "artifacts.json").write_text(json.dumps({"tasq": name * 8}))
    keys = [(t, i) for t in CONFIG["tasks"] for i in range(2)]
    preds = [{"task": t, "index": i, "length": 900, "gold": [f"{gold}{t}{i}"],
              "pred": f"{gold}{t}{i}" if hit else "no"} for (t, i), hit in zip(keys, hits)]
    (run / "items" / f"{Point.parse(point).slug}__1024.json").write_text(json.dumps(
        {"point": point, "length": 1024, "mean_length": 900.0, "preds": preds}))
    return run


def test_paired_difference_counts_each_sample_once(tmp_path):
    a = ("before", _run(tmp_path, "a", [1, 0, 0, 0]))
    b = ("after", _run(tmp_path, "b", [1, 1, 1, 0]))
    (row,) = cr.compare(a, b, "tasq:64+256", [1024])
    assert row["before"]["mean"] == 25.0 and row["after"]["mean"] == 75.0  # mean over tasks of task means
    assert row["b_minus_a"]["mean"] == 50.0 and (row["b_up"], row["b_down"], row["n"]) == (2, 0, 4)
    md = cr.markdown(a, b, "tasq:64+256", [row])
    assert "| 1024 (900) | 4 | 25.0" in md and "after - before" in md


def test_other_samples_or_workloads_are_refused(tmp_path):
    a = ("a", _run(tmp_path, "a", [1, 1, 1, 1]))
    with pytest.raises(ValueError, match="samples differ"):
        cr.compare(a, ("b", _run(tmp_path, "b", [1, 1, 1, 1], gold="8")), "tasq:64+256", [1024])
    with pytest.raises(ValueError, match=r"different workloads .*'samples': \(2, 8\)"):
        cr.compare(a, ("c", _run(tmp_path, "c", [1, 1, 1, 1], config={**CONFIG, "samples": 8})), "tasq:64+256", [1024])
    with pytest.raises(ValueError, match="no item for tasq:64\\+256 at 2048"):
        cr.compare(a, ("d", _run(tmp_path, "d", [1, 1, 1, 1])), "tasq:64+256", [2048])
    assert cr.main(["--a", "x=" + str(a[1]), "--b", "x=" + str(a[1])]) == 2  # one label for both sides


def test_two_points_of_the_same_samples_pair_across_folders(tmp_path):
    last = ("last", _run(tmp_path, "a", [1, 1, 1, 0]))
    first = ("first", _run(tmp_path, "b", [1, 0, 1, 0], point="tasq:64+256:first"))
    (row,) = cr.compare(last, first, "tasq:64+256", [1024], point_b="tasq:64+256:first")
    assert row["b_minus_a"]["mean"] == -25.0 and (row["b_up"], row["b_down"]) == (0, 1)
    assert "tasq:64+256 (last) and tasq:64+256:first (first)" in cr.markdown(last, first, "tasq:64+256", [row],
                                                                              "tasq:64+256:first")
    with pytest.raises(ValueError, match="no item for tasq:64\\+256:first"):
        cr.compare(last, last, "tasq:64+256", [1024], point_b="tasq:64+256:first")


def _server_run(tmp_path, name, hits, question="first", samples=2, gold="7"):
    """A bench.quality run folder of the NIAH server view whose served tasq item at 1024 answers
    sample i right where hits[i] (its cold pass)."""
    run = tmp_path / name
    (run / "items" / "ruler_server").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({
        "model": "smollm2-135m", "preset": "default", "niah_view": "server", "niah_question": question,
        "niah_samples": samples, "niah_tasks": CONFIG["tasks"], "niah_max_new": None, "model_dtype": "float32"}))
    (run / "artifacts.json").write_text(json.dumps({"tasq": "c" * 64 + "+serving:" + "d" * 16}))
    keys = [(t, i) for t in CONFIG["tasks"] for i in range(2)]
    preds = [{"task": t, "index": i, "length": 880 + i, "gold": [f"{gold}{t}{i}"],
              "pred": f"{gold}{t}{i}" if hit else "no", "pred_warm": "no"} for (t, i), hit in zip(keys, hits)]
    (run / "items" / "ruler_server" / "tasq__64+256__1024.json").write_text(json.dumps(
        {"length": 1024, "view": "server", "windows": "64+256", "preds": preds}))
    return run


def test_a_server_view_run_pairs_with_the_decode_view(tmp_path):
    """A quality run of the server view is one side: its cold answers, paired with the decode view's
    point on the same samples (the question order must match; another model dtype is the server's)."""
    point = "tasq:64+256:S36/192L17a12e:x8:first"
    dec = ("decode", _run(tmp_path, "a", [1, 0, 1, 0], point=point))
    srv = ("server", _server_run(tmp_path, "s", [1, 1, 1, 0]))
    (row,) = cr.compare(dec, srv, point, [1024])
    assert row["server"]["mean"] == 75.0 and row["b_minus_a"]["mean"] == 25.0 and (row["b_up"], row["b_down"]) == (1, 0)
    assert "+serving:dddd" in cr.markdown(dec, srv, point, [row])
    with pytest.raises(ValueError, match="asked the question first, tasq:64\\+256 asks it last"):
        cr.compare(("d2", _run(tmp_path, "b", [1, 1, 1, 1])), srv, "tasq:64+256", [1024])
    with pytest.raises(ValueError, match="different workloads"):
        cr.compare(dec, ("s8", _server_run(tmp_path, "s8", [1, 1, 1, 1], samples=8)), point, [1024])
    with pytest.raises(ValueError, match="samples differ"):
        cr.compare(dec, ("s9", _server_run(tmp_path, "s9", [1, 1, 1, 1], gold="8")), point, [1024])

"""Calibration on the real model (SmolLM2-135M) at a small rate and size: TaSQ's held-out
attention-logit error is below CQ's with the same codebooks, and the artifact it writes is
valid for that model. One capture serves both fits."""
import json
import subprocess
import sys

import pytest

from calibrate import pipeline
from sglang_tasq.artifact import load_artifact
from sglang_tasq.config import TaSQConfig
from sglang_tasq.models import fingerprint, load_config

SMALL = dict(codebook_size_k=64, codebook_size_v=64, calib_tokens=4096, fisher_tokens=2048,
             max_kmeans_samples=4096, kmeans_iters=6)  # k-means points: the 2,048 Fisher tokens


@pytest.fixture(scope="module")
def prepared():
    return pipeline.prepare("smollm2-135m", TaSQConfig(**SMALL), progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def tasq(prepared):
    return pipeline.fit(prepared, TaSQConfig(**SMALL), progress=False, log=lambda s: None)


def test_tasq_logit_error_below_cq_on_heldout_keys(prepared, tasq):
    cq = pipeline.fit(prepared, TaSQConfig.cq(**SMALL), progress=False, log=lambda s: None)
    t, c = tasq.errors["logit_nmse"], cq.errors["logit_nmse"]
    assert t < c, f"TaSQ logit NMSE {t:.4f} is not below CQ's {c:.4f}"
    # the grouping lowers its own objective against contiguous pairs
    gc = tasq.errors["group_cost"]
    assert gc["chosen"] < gc["contiguous"]
    km = tasq.calibration["kmeans"]
    assert km["points_per_codebook"] == 2048 and 1 <= km["iters_min"] <= km["iters_max"] <= 6


def test_artifact_is_valid_for_the_model(tasq, smollm2_dir, tmp_path):
    mpath = pipeline.write(tasq, tmp_path / "a")
    fp = fingerprint(load_config(smollm2_dir))
    art = load_artifact(mpath, model=fp)
    assert art.manifest["bits_k"] == pytest.approx(6 / 8 + 16 / (3 * 64))
    assert art.manifest["bits_v"] == pytest.approx(6 / 8)
    w = art.codebooks.k_weight
    assert ((w.pow(2).mean(-1) - 1).abs() < 1e-4).all()
    r = subprocess.run([sys.executable, "-m", "calibrate", "check", str(mpath), "--model", "smollm2-135m"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "matches smollm2-135m" in r.stdout, r.stderr
    m = json.loads(mpath.read_text())
    assert m["calibration"]["tokens"] == 4096 and m["calibration"]["fisher_tokens"] == 2048

"""A named rate other than the paper's, served: ``calibrate --rate 1.7`` (keys 4-dim groups x 256
codewords, values 8 x 1,024: 8- and 10-bit codes and two group sizes in one pool) through a real
SGLang server gives the NIAH answers the HF decode view gives on the same artifact and samples; so
does a per-layer key rate (``calibrate --mix-layers``: two key rates, rows of two widths, in one pool).

The artifact is a fast-preset calibration of SmolLM2 (cached; ~1 min on 2 cores): the check is
that the server reads what the HF cache reads, not the preset's quality. The samples are RULER
tasks that TaSQ answers at 1k, so that agreeing answers are not two failures agreeing, and whose
answers do not sit at a near-tie (a multi-key sample's wrong answer differed between the views:
both scored 0, but on another CPU one of them may not)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import quality as Q
from bench import ruler, ruler_server as RS
from bench.methods import parse

from _support import ROOT

NAME = "tasq@g4k256/g8k1024"  # what --rate 1.7 makes
TASKS = ("niah_single_1", "niah_single_2")  # answered at 1k (100 in both views): a path that misreads fails them


@pytest.fixture(scope="module")
def rate_artifact() -> Path:
    from sglang_tasq.paths import cache_dir

    out = cache_dir("artifacts") / "smollm2_rate1.7_fast"
    if not (out / "tasq.json").is_file():
        subprocess.run([sys.executable, "-m", "calibrate", "--model", "smollm2-135m", "--out", str(out), "--rate", "1.7",
                        "--preset", "fast", "--quiet"], check=True, cwd=str(ROOT), timeout=1200)
    return out


def _served_as_decoded(tmp_path, name: str, artifacts: tuple, tokenizer, bits: tuple) -> None:
    """The server's NIAH answers for method ``name`` (artifacts: (name, dir) pairs) equal the HF
    decode view's on the same artifact and samples, cold and warm."""
    cfg = Q.QualityConfig(methods=(name,), benches=("ruler",), niah_view="server", niah_methods=(name,), preset="fast",
                          niah_lengths=(1024,), niah_samples=1, niah_tasks=TASKS, niah_max_new=64, artifacts=artifacts)
    decode_cfg = dataclasses.replace(cfg, niah_view="decode")
    logs = []
    dctx = Q.build_context(decode_cfg, tmp_path / decode_cfg.name(), logs.append)
    assert dctx.bits[name] == bits
    dec = ruler.run(dctx, settings=("64+256",))[name]["64+256"]["1024"]

    sctx = SimpleNamespace(cfg=cfg, tok=tokenizer, methods={name: None}, run_dir=tmp_path / cfg.name(),
                           log=logs.append)
    item = RS.run(sctx)[name]["64+256"]["1024"]  # served with the artifact's windows; joined with the decode run
    assert item["decode_run"] == decode_cfg.name() and item["n_preds"] == len(TASKS)
    print({t: (dec["tasks"][t], item["tasks"][t]) for t in TASKS},
          [(p["pred"], p["decode_pred"]) for p in item["preds"]])
    assert dec["avg"] > 0, dec["preds"]  # the decode view finds needles: agreement below is not vacuous
    assert item["agree_score_all"] == 1.0 and item["tasks"] == dec["tasks"], (item["tasks"], dec["tasks"])
    assert item["warm_equal_all"] == 1.0, [(p["pred"], p["pred_warm"]) for p in item["preds"]]


def test_rate_1_7_served_answers_as_the_decode_view(tmp_path, rate_artifact, smollm2_tokenizer):
    spec = parse(NAME)
    assert spec.artifact_name == "tasq_g4k256_g8k1024"
    _served_as_decoded(tmp_path, NAME, ((spec.artifact_name, str(rate_artifact)),), smollm2_tokenizer, (2.0833, 1.25))


MIX = "tasq+tasq@g4k256/g8k1024@L17,18,21,23"  # the retrieval-head layers' keys at the 1.7 rate


@pytest.fixture(scope="module")
def mixed_artifact() -> Path:
    from sglang_tasq.paths import cache_dir

    out = cache_dir("artifacts") / "smollm2_mix17-23_fast"
    if not (out / "tasq.json").is_file():
        subprocess.run([sys.executable, "-m", "calibrate", "--model", "smollm2-135m", "--out", str(out),
                        "--mix-layers", "17,18,21,23", "--preset", "fast", "--quiet"], check=True, cwd=str(ROOT),
                       timeout=1200)
    return out


def test_per_layer_key_rate_served_answers_as_the_decode_view(tmp_path, mixed_artifact, smollm2_tokenizer):
    """``calibrate --mix-layers``: four layers' keys at 4 x 256 (8-bit codes, 16 groups) and 26 at
    8 x 1,024 in one pool, rows of two widths; keys 1.433 bits averaged over the layers."""
    from sglang_tasq.artifact import load_artifact

    cfg = load_artifact(mixed_artifact).config
    assert cfg.mix_layers == (17, 18, 21, 23) and cfg.key_rate(17) == (4, 256) and cfg.key_rate(0) == (8, 1024)
    spec = parse(MIX)
    _served_as_decoded(tmp_path, MIX, ((spec.mixed_artifact_name, str(mixed_artifact)),), smollm2_tokenizer,
                       (1.4333, 1.25))

"""The artifact: round trip, and every malformed or mismatched artifact refused with its message."""
import dataclasses
import hashlib
import json
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from sglang_tasq.artifact import ArtifactError, ModelFingerprint, load_artifact, save_artifact
from sglang_tasq.config import TaSQConfig
from sglang_tasq.testing import random_codebooks

FP = ModelFingerprint("LlamaForCausalLM", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      rope_theta=10000.0, rope_scaling=None)
CALIB = {"corpus": "test", "tokens": 0, "seed": 0, "wall_time_s": 0.0}


@pytest.fixture
def art(tmp_path):
    cb = random_codebooks(2, 2, 16, TaSQConfig(codebook_size_k=64, codebook_size_v=64), seed=0)
    return save_artifact(tmp_path / "a", cb, FP, CALIB)


def _edit_manifest(path, fn):
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def _edit_tensors(path, fn):
    """Mutate the tensors and re-sign the manifest, so only the tensor check can catch it."""
    tpath = path.parent / "tasq.safetensors"
    t = load_file(str(tpath))
    fn(t)
    save_file(t, str(tpath))
    data = tpath.read_bytes()
    _edit_manifest(path, lambda m: m["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


def test_round_trip(art):
    a = load_artifact(art, model=FP)
    assert a.codebooks.k_codebook.shape == (2, 2, 2, 64, 8)
    assert a.manifest["bits_k"] == pytest.approx(6 / 8 + 16 / 32)
    assert load_artifact(art.parent).path == art


def _split_pair(t):
    p = t["k.perm"]
    p[0, 1, [0, 1]] = p[0, 1, [1, 0]]  # channel order kept a permutation, but a pair is split
    p[0, 1, [0, 8]] = p[0, 1, [8, 0]]


CASES = [
    ("version", lambda p: _edit_manifest(p, lambda m: m.update(format_version=99)), "format_version"),
    ("format", lambda p: _edit_manifest(p, lambda m: m.update(format="other")), "format"),
    ("json", lambda p: p.write_text("{not json"), "not valid JSON"),
    ("missing-field", lambda p: _edit_manifest(p, lambda m: m.pop("bits_k")), "bits_k: missing"),
    ("bits", lambda p: _edit_manifest(p, lambda m: m.update(bits_v=1.0)), "bits_v"),
    ("config", lambda p: _edit_manifest(p, lambda m: m["config"].update(weighting="magic")), "weighting"),
    ("missing-file", lambda p: (p.parent / "tasq.safetensors").unlink(), "tensors.file: missing"),
    ("truncated", lambda p: (p.parent / "tasq.safetensors").write_bytes((p.parent / "tasq.safetensors").read_bytes()[:1000]),
     "tensors.bytes"),
    ("checksum", lambda p: _edit_manifest(p, lambda m: m["tensors"].update(sha256="0" * 64)), "tensors.sha256"),
    ("nan", lambda p: _edit_tensors(p, lambda t: t["v.codebook"].view(-1).__setitem__(5, float("nan"))), "NaN or Inf"),
    ("inf", lambda p: _edit_tensors(p, lambda t: t["k.codebook"].view(-1).__setitem__(0, float("inf"))), "tensor k.codebook"),
    ("shape", lambda p: _edit_tensors(p, lambda t: t.update({"k.weight": t["k.weight"][:, :1].contiguous()})), "tensor k.weight: shape"),
    ("missing-tensor", lambda p: _edit_tensors(p, lambda t: t.pop("v.codebook")), "tensor v.codebook: missing"),
    ("split-pair", lambda p: _edit_tensors(p, _split_pair), "splits a RoPE pair"),
    ("not-perm", lambda p: _edit_tensors(p, lambda t: t["k.perm"].__setitem__((0, 0, 0), t["k.perm"][0, 0, 1])), "not a permutation"),
    ("weights", lambda p: _edit_tensors(p, lambda t: t["k.weight"].mul_(2)), "mean(w^2)"),
]


@pytest.mark.parametrize("name,mutate,msg", CASES, ids=[c[0] for c in CASES])
def test_malformed_artifact_is_refused_with_its_message(art, name, mutate, msg):
    mutate(art)
    with pytest.raises(ArtifactError, match=re.escape(msg)):
        load_artifact(art)


@pytest.mark.parametrize("field,value", [("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 32), ("rope_theta", 5e5)])
def test_mismatched_model_is_refused(art, field, value):
    other = dataclasses.replace(FP, **{field: value})
    with pytest.raises(ArtifactError, match=f"model.{field}"):
        load_artifact(art, model=other)


def test_check_cli_exit_codes(art):
    ok = subprocess.run([sys.executable, "-m", "calibrate", "check", str(art)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:") and "bits/elem" in ok.stdout
    _edit_manifest(art, lambda m: m.update(format_version=2))
    bad = subprocess.run([sys.executable, "-m", "calibrate", "check", str(art)], capture_output=True, text=True)
    assert bad.returncode != 0
    assert len(bad.stderr.strip().splitlines()) == 1 and "format_version" in bad.stderr


def test_cq_channel_groups_load_but_do_not_hold_rope_pairs(tmp_path):
    """CQ's native channel groups (identity permutation) are a valid artifact for the plain-torch
    paths; it says it cannot be served by RoPE in the permuted space; a non-identity permutation
    with grouping 'channels' is refused."""
    cfg = TaSQConfig.cq(codebook_size_k=64, codebook_size_v=64)
    path = save_artifact(tmp_path / "cq", random_codebooks(2, 2, 16, cfg), FP, CALIB)
    cb = load_artifact(path, model=FP).codebooks
    assert cb.config.grouping == "channels" and not cb.pairs_in_groups
    with pytest.raises(ValueError, match="split RoPE pairs"):
        cb.rope_freq_perm(0)
    assert load_artifact(save_artifact(tmp_path / "t", random_codebooks(2, 2, 16), FP, CALIB)).codebooks.pairs_in_groups
    _edit_tensors(path, lambda t: t.update({"k.perm": t["k.perm"].flip(-1).contiguous()}))
    with pytest.raises(ArtifactError, match="grouping 'channels' needs the identity permutation"):
        load_artifact(path)

"""Launch-time refusals: every malformed or mismatched artifact and every unsupported server
option is refused with one line naming the cause (in process, seconds), and the real launchers
(``python -m sglang.launch_server``, ``sglang.Engine``) exit non-zero with that one line
before any weights load (subprocess, minutes). All ``slow``: tests/integration is."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from _support import ROOT
from engine_worker import make_random_artifact, run_worker
from sglang_tasq.srt.launch import TaSQLaunchError, validate


@pytest.fixture(scope="module")
def good(tmp_path_factory, smollm2_dir):
    return make_random_artifact(tmp_path_factory.mktemp("good"), smollm2_dir)


@pytest.fixture
def args(smollm2_dir):
    """``args(**overrides)``: the server arguments ``validate`` reads, for SmolLM2 by default."""
    def make(**kw):
        base = dict(model_path=str(smollm2_dir), attention_backend=None, prefill_attention_backend=None,
                    decode_attention_backend=None, speculative_algorithm=None, page_size=None, tp_size=1,
                    pp_size=1, dp_size=1, kv_cache_dtype="auto")
        base.update(kw)
        return SimpleNamespace(**base)
    return make


def _assert_refused(sa, path, *needles):
    with pytest.raises(TaSQLaunchError) as ei:
        validate(sa, str(path))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("tasq:")
    for n in needles:
        assert n in msg, msg
    return msg


def test_good_artifact_passes(good, args):
    art = validate(args(), str(good))
    assert art.model.num_layers == 30


@pytest.mark.parametrize("kw,needle", [
    (dict(page_size=16), "--page-size 16"), (dict(pp_size=2), "--pp-size 2"),
    (dict(enable_dp_attention=True), "--enable-dp-attention"),
    (dict(tp_size=2), "--tp 2 does not divide the model's 3 KV heads"),
    (dict(tp_size=3), "--tp 3: the artifact shares one key scale over 3 KV heads"),
    (dict(speculative_algorithm="EAGLE"), "speculative"), (dict(kv_cache_dtype="fp8_e4m3"), "--kv-cache-dtype fp8_e4m3"),
    (dict(attention_backend="triton"), "--attention-backend triton")])
def test_unsupported_server_options(good, args, kw, needle):
    _assert_refused(args(**kw), good, needle)


def test_parallel_degrees_the_artifact_serves(tmp_path, good, args, smollm2_dir):
    """--dp N always; --tp N when the artifact's key-scale groups lie inside the ranks
    (``calibrate --tp N``), on CPU and CUDA alike; TP 1 serves any grouping."""
    assert validate(args(dp_size=2), str(good)).model.num_kv_heads == 3
    tp3 = make_random_artifact(tmp_path / "tp3", smollm2_dir, scale_groups=3)
    for kw in (dict(tp_size=3), dict(tp_size=1), dict(tp_size=3, dp_size=2), dict(tp_size=3, device="cuda")):
        assert validate(args(**kw), str(tp3)).config.scale_groups == 3
    _assert_refused(args(tp_size=2), tp3, "--tp 2 does not divide")


def test_salient_tokens_are_served_at_tp1(tmp_path, smollm2_dir, args):
    """An artifact keeping salient tokens (issue 14) serves at --tp 1 and --dp N, on CPU and CUDA
    (tests/kernels/test_salient_cuda.py); a TP rank sees only its heads' echo: refused, by name.
    A deciding layer the model lacks is refused as a malformed artifact."""
    sal = make_random_artifact(tmp_path / "sal", smollm2_dir, scale_groups=3, salient_budget=36, salient_layer=17)
    for kw in (dict(), dict(dp_size=2), dict(device="cpu"), dict(device="cuda")):
        assert validate(args(**kw), str(sal)).config.salient_spec().layer == 17
    _assert_refused(args(tp_size=3), sal, "salient tokens", "--tp 1")
    bad = make_random_artifact(tmp_path / "bad", smollm2_dir, salient_budget=36, salient_layer=31)
    _assert_refused(args(), bad, "salient_layer=31", "layers 0..29")


def test_cq_channel_grouped_artifact_is_refused(tmp_path, smollm2_dir, args):
    cq = make_random_artifact(tmp_path / "cq", smollm2_dir, weighting="none", scale="none", grouping="channels")
    _assert_refused(args(), cq, "contiguous channels", "splits RoPE pairs", "--method tasq")


def test_novakv_post_rope_artifact_is_refused(tmp_path, smollm2_dir, args):
    nova = make_random_artifact(tmp_path / "nova", smollm2_dir, weighting="qpca", scale="per_head",
                                grouping="stratified", fisher=False, key_rope="post", group_size_k=4)
    _assert_refused(args(), nova, "after RoPE", "NovaKV", "--method tasq")


def _copy(good, tmp_path):
    d = tmp_path / "art"
    shutil.copytree(good.parent, d)
    return d / "tasq.json"


def test_wrong_model_shapes(tmp_path, smollm2_dir, args):
    from sglang_tasq.artifact import save_artifact
    from sglang_tasq.models import fingerprint, load_config
    from sglang_tasq.testing import random_codebooks
    import dataclasses

    fp = dataclasses.replace(fingerprint(load_config(smollm2_dir)), num_layers=2)
    path = save_artifact(tmp_path, random_codebooks(2, 3, 64, rope_theta=1e5), fp, calibration={})
    _assert_refused(args(), path, "model.num_layers", "artifact has 2", "model has 30")


def test_wrong_rope_theta(good, args, tmp_path):
    p = _copy(good, tmp_path)
    m = json.loads(p.read_text())
    m["model"]["rope_theta"] = 10000.0
    p.write_text(json.dumps(m))
    _assert_refused(args(), p, "model.rope_theta")


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "tensors.bytes"), ("json", "not valid JSON"), ("missing", "no such file"),
    ("version", "format_version"), ("bits", "bits_k")])
def test_malformed_artifacts(good, args, tmp_path, damage, needle):
    p = _copy(good, tmp_path)
    if damage == "truncate":
        t = p.parent / "tasq.safetensors"
        t.write_bytes(t.read_bytes()[:1000])
    elif damage == "json":
        p.write_text("{not json")
    elif damage == "missing":
        p = p.parent / "nope.json"
    else:
        m = json.loads(p.read_text())
        m["format_version" if damage == "version" else "bits_k"] = 99
        p.write_text(json.dumps(m))
    _assert_refused(args(), p, needle)


@pytest.mark.parametrize("extra,needle", [({"kv_lora_rank": 512}, "MLA"),
                                          ({"sliding_window": 4096, "use_sliding_window": True}, "sliding-window")])
def test_unsupported_models(good, args, smollm2_dir, tmp_path, extra, needle):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg.update(extra)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _assert_refused(args(model_path=str(tmp_path)), good, needle)


def test_launch_server_refuses_in_one_line(good, smollm2_dir, tmp_path):
    bad = _copy(good, tmp_path)
    (bad.parent / "tasq.safetensors").write_bytes(b"x" * 10)
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(smollm2_dir),
                        "--tasq-config", str(bad), "--device", "cpu", "--host", "127.0.0.1"],
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("tasq:")]
    assert len(lines) == 1 and "tensors.bytes" in lines[0], p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == lines[0]


def test_help_shows_flag_and_engine_refuses(good, smollm2_dir, tmp_path):
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
                       text=True, timeout=300, cwd=str(ROOT))
    assert "--tasq-config" in p.stdout and "tasq" in p.stdout
    spec = {"engine": {"model_path": str(smollm2_dir), "page_size": 16}, "tasq_config": str(good), "tasks": []}
    rc, out, err = run_worker(spec, tmp_path, "refuse", timeout=300)
    assert rc == 2 and out is None
    assert err.strip().splitlines()[-1].startswith("tasq: --page-size 16"), err[-2000:]


def test_per_layer_key_rate_artifact_is_served(tmp_path, smollm2_dir, args):
    """A ``calibrate --mix-layers`` artifact passes launch on CPU and CUDA (both take a key rate per
    layer); one whose mixed layers the model lacks is refused naming them."""
    mixed = make_random_artifact(tmp_path / "mixed", smollm2_dir, mix_layers=(17, 18))
    for kw in ({}, dict(device="cuda")):
        assert validate(args(**kw), str(mixed)).config.mix_layers == (17, 18)
    bad = tmp_path / "bad"
    shutil.copytree(mixed.parent, bad)
    man = json.loads((bad / "tasq.json").read_text())
    man["config"]["mix_layers"] = [17, 30]
    (bad / "tasq.json").write_text(json.dumps(man))
    _assert_refused(args(), bad / "tasq.json", "mix_layers [30]: the model has layers 0..29")

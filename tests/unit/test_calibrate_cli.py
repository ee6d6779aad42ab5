"""``python -m calibrate`` options: the methods' configs, and a bad --device refused before any work."""
import math

import pytest
import torch

from calibrate import cli, pipeline
from sglang_tasq.config import RATES, ConfigError, TaSQConfig


def test_cq_is_coupled_quantization_as_published():
    cfg = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--method", "cq"]))
    assert (cfg.weighting, cfg.scale, cfg.grouping, cfg.fisher, cfg.kmeans) == ("none", "none", "channels", True, "flat")
    pairs = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--method", "cq_pairs"]))
    assert pairs == TaSQConfig.cq_pairs() and pairs.grouping == "contiguous" and not pairs.fisher
    tasq = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--kmeans-tol", "0", "--iters", "40"]))
    assert (tasq.grouping, tasq.kmeans_tol, tasq.kmeans_iters, tasq.max_kmeans_samples) == ("covariance", 0.0, 40, 32768)


def test_named_rates_and_per_side_sizes(capsys):
    parse = lambda *argv: cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", *argv]))  # noqa: E731
    sizes = lambda c: (c.group_size_k, c.codebook_size_k, c.group_size_v, c.codebook_size_v)  # noqa: E731
    assert sizes(parse()) == sizes(parse("--rate", "1.3")) == (8, 1024, 8, 1024)
    assert sizes(parse("--rate", "2.1")) == (4, 256, 4, 256) and sizes(parse("--rate", "1.7")) == (4, 256, 8, 1024)
    assert sizes(parse("--rate", "2.1", "--preset", "fast")) == (4, 256, 4, 256)
    for name, (gk, kk, gv, kv) in RATES.items():  # each name is its mean code bits, the keys' fp16 scale included
        key_bits = math.log2(kk) / gk + 16 / (3 * 64)
        assert abs((key_bits + math.log2(kv) / gv) / 2 - float(name)) < 0.07, name  # 1.29, 1.67, 2.04
    assert sizes(parse("--group-size", "4", "--codebook-size", "64", "--codebook-size-v", "512")) == (4, 64, 4, 512)
    assert sizes(parse("--group-size-k", "4", "--codebook-size-k", "256")) == (4, 256, 8, 1024)
    with pytest.raises(ConfigError, match="--rate 1.7 .* --codebook-size-k"):  # two answers to one question: refused
        parse("--rate", "1.7", "--codebook-size-k", "128")
    assert cli.main(["--out", "never-written", "--rate", "2.1", "--group-size", "8"]) == 2
    assert "cannot be combined with --group-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--rate", "1.6")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused(capsys):
    assert cli.main(["--out", "never-written", "--device", "cuda"]) == 2
    assert "--device cuda: this torch has no CUDA device" in capsys.readouterr().err
    assert cli.main(["--out", "never-written", "--device", "tpu"]) == 2


def test_device_default_and_explicit():
    assert pipeline.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pipeline.resolve_device("cpu") == torch.device("cpu")


def test_serving_rewrites_the_serving_settings_only(tmp_path, capsys):
    """``calibrate serving``: the same tensors and calibration record, other windows / salient
    tokens; a setting the windows or the model cannot serve is refused, nothing written."""
    from sglang_tasq.artifact import ModelFingerprint, load_artifact, save_artifact
    from sglang_tasq.testing import random_codebooks

    cb = random_codebooks(4, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=1)
    fp = ModelFingerprint(architecture="LlamaForCausalLM", num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          rope_theta=10000.0, rope_scaling=None)
    src = save_artifact(tmp_path / "src", cb, fp, calibration={"corpus": "random", "tokens": 0, "seed": 1, "wall_time_s": 0.0})
    assert cli.main(["serving", str(src), "--out", str(tmp_path / "sal"), "--salient", "36/192@3"]) == 0
    new = load_artifact(tmp_path / "sal")
    assert new.config.salient_spec().layer == 3 and new.config.salient_budget == 36
    assert new.manifest["tensors"]["sha256"] == load_artifact(src).manifest["tensors"]["sha256"]
    assert "salient tokens: 36 of every 192" in capsys.readouterr().out
    assert cli.main(["serving", str(tmp_path / "sal"), "--out", str(tmp_path / "off"), "--salient", "none"]) == 0
    assert load_artifact(tmp_path / "off").config.salient_spec() is None
    for bad, needle in ((["--salient", "36/192@4"], "salient_layer=4"), (["--salient", "36/300@1"], "recent window >= 333"),
                        (["--salient", "36/192@1", "--recent", "200"], "recent window >= 225")):
        assert cli.main(["serving", str(src), "--out", str(tmp_path / "bad"), *bad]) == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    # fp8 exact copies: recorded and shown; refused without windows (nothing to hold)
    assert cli.main(["serving", str(tmp_path / "sal"), "--out", str(tmp_path / "x8"), "--exact", "fp8"]) == 0
    x8 = load_artifact(tmp_path / "x8").config
    assert x8.exact_format == "fp8" and x8.salient_budget == 36 and load_artifact(src).config.exact_format == "bf16"
    assert "exact copies held as fp8" in capsys.readouterr().out
    assert cli.main(["serving", str(src), "--out", str(tmp_path / "bad"), "--exact", "fp8", "--sink", "0",
                     "--recent", "0"]) == 2
    assert "exact_format='fp8' without windows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serving", str(src), "--out", str(tmp_path / "bad"), "--exact", "fp4"])
    with pytest.raises(ConfigError, match="exact_format='int8': allowed"):
        TaSQConfig(exact_format="int8")
    assert not (tmp_path / "bad").exists()

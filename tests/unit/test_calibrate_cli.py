"""``python -m calibrate`` options: the methods' configs, and a bad --device refused before any work."""
import torch
import pytest

from calibrate import cli, pipeline
from sglang_tasq.config import TaSQConfig


def test_cq_is_coupled_quantization_as_published():
    cfg = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--method", "cq"]))
    assert (cfg.weighting, cfg.scale, cfg.grouping, cfg.fisher, cfg.kmeans) == ("none", "none", "channels", True, "flat")
    pairs = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--method", "cq_pairs"]))
    assert pairs == TaSQConfig.cq_pairs() and pairs.grouping == "contiguous" and not pairs.fisher
    tasq = cli.build_config(cli._calibrate_parser().parse_args(["--out", "x", "--kmeans-tol", "0", "--iters", "40"]))
    assert (tasq.grouping, tasq.kmeans_tol, tasq.kmeans_iters, tasq.max_kmeans_samples) == ("covariance", 0.0, 40, 32768)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused(capsys):
    assert cli.main(["--out", "never-written", "--device", "cuda"]) == 2
    assert "--device cuda: this torch has no CUDA device" in capsys.readouterr().err
    assert cli.main(["--out", "never-written", "--device", "tpu"]) == 2


def test_device_default_and_explicit():
    assert pipeline.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pipeline.resolve_device("cpu") == torch.device("cpu")

"""The dtype models run in outside the server: bf16 where the CPU has bf16 matmuls, float32 where
torch would fall back to its slow generic bf16 kernel (AVX2-only x86), and the override."""
import pytest
import torch

from sglang_tasq import models, options


def test_auto_follows_the_cpus_bf16_matmul_support(monkeypatch):
    monkeypatch.delenv(options.ENV_DTYPE, raising=False)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert models.native_bf16("cpu") is native
    assert models.compute_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("value,dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_the_variable_overrides_the_policy(monkeypatch, value, dtype):
    monkeypatch.setenv(options.ENV_DTYPE, value)
    assert models.compute_dtype("cpu") == dtype


def test_a_bad_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(options.ENV_DTYPE, "fp16")
    with pytest.raises(options.OptionError, match="SGLANG_TASQ_DTYPE='fp16'.*auto, bfloat16, float32"):
        models.compute_dtype("cpu")


def test_bench_run_names_keep_bf16_names_and_split_float32(monkeypatch):
    from bench.quality import QualityConfig

    monkeypatch.setenv(options.ENV_DTYPE, "bfloat16")
    bf16 = QualityConfig().name()
    monkeypatch.setenv(options.ENV_DTYPE, "float32")
    assert QualityConfig().name() != bf16

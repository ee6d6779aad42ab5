"""Closed-form baselines: round-trip error on Gaussian data and exact bits accounting."""
import pytest
import torch

from sglang_tasq.hf.baselines import (FP8_MAX, KIVIKeys, KIVIValues, FP8E4M3, Identity, KVMethod,
                                   SideQuantizer, baseline)
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import TaSQKeys, TaSQValues
from sglang_tasq.testing import random_codebooks


def _gauss(T=64, H=2, d=64, seed=0):
    return torch.randn(T, H, d, generator=torch.Generator().manual_seed(seed))


def _payload_bits(payload: dict, state: dict, T: int, H: int, d: int) -> float:
    return 8 * (sum(v.nbytes for v in payload.values())) / (T * H * d)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "kivi2"])
def test_protocol(name):
    m = baseline(name)
    assert isinstance(m, KVMethod)
    assert isinstance(m.keys, SideQuantizer) and isinstance(m.values, SideQuantizer)
    assert not m.keys.pre_rope


def test_unknown_baseline_names_allowed():
    with pytest.raises(ValueError, match="kivi2"):
        baseline("int4")


def test_identity_exact():
    x = _gauss().to(torch.bfloat16)
    q = Identity()
    assert torch.equal(q.decode(q.encode(x, 0, {}), 0, {}), x.float())
    assert q.bits_per_element(2, 64) == 16.0


def test_fp8_roundtrip_and_static_scale():
    x = _gauss()
    q, state = FP8E4M3(), {}
    p = q.encode(x, 0, state)
    xh = q.decode(p, 0, state)
    assert p["codes"].dtype == torch.float8_e4m3fn
    rel = (xh - x).norm() / x.norm()
    assert rel < 0.04  # e4m3: 3 mantissa bits
    assert ((xh - x).abs() <= x.abs() * 2 ** -4 + state["scale"] * 2 ** -9).all()
    scale = state["scale"].clone()
    y = 10 * _gauss(seed=1)  # later tokens: same scale, saturating beyond the prefill range
    yh = q.decode(q.encode(y, 0, state), 0, state)
    assert torch.equal(state["scale"], scale)
    assert yh.abs().max() <= FP8_MAX * scale + 1e-6
    assert _payload_bits(p, state, 64, 2, 64) == q.bits_per_element(2, 64) == 8.0


def test_kivi_keys_per_channel_error_bound_and_bits():
    x = _gauss(T=64)
    q = KIVIKeys(2, 32)
    p = q.encode(x, 0, {})
    assert p["codes"].shape == (2, 32 * 2 * 64 * 2 // 8) and p["scale"].shape == (2, 2, 64)
    xh = q.decode(p, 0, {})
    step = p["scale"].float().repeat_interleave(32, dim=0)  # [T, H, d] per-channel step
    assert ((xh - x).abs() <= step / 2 * 1.01 + 1e-3).all()
    assert (xh - x).norm() / x.norm() < 0.45  # 2 bits over ~4 sigma: rms step/sqrt(12) ~ 0.385
    assert _payload_bits(p, {}, 64, 2, 64) == q.bits_per_element(2, 64) == 3.0


def test_kivi_values_per_token_error_bound_and_bits():
    x = _gauss(T=64)
    q = KIVIValues(2, 32, 32)
    p = q.encode(x, 0, {})
    assert p["scale"].shape == (2, 32, 2, 2)
    xh = q.decode(p, 0, {})
    step = p["scale"].float().reshape(64, 2, 2).repeat_interleave(32, dim=-1)
    assert ((xh - x).abs() <= step / 2 * 1.01 + 1e-3).all()
    assert (xh - x).norm() / x.norm() < 0.45  # 2 bits over ~4 sigma: rms step/sqrt(12) ~ 0.385
    assert _payload_bits(p, {}, 64, 2, 64) == q.bits_per_element(2, 64) == 3.0


def test_kivi_constant_channel_is_exact():
    x = torch.full((32, 1, 32), 0.5)
    q = KIVIKeys()
    assert torch.allclose(q.decode(q.encode(x, 0, {}), 0, {}), x, atol=1e-3)


def test_tasq_payload_bits_match_config():
    """SmolLM2 shapes: 24 10-bit codes pack to 30 bytes, + 2-byte scale = 1.333 bits/elt."""
    cfg = TaSQConfig(codebook_size_k=1024, codebook_size_v=1024)
    cb = random_codebooks(1, 3, 64, config=cfg)
    x = _gauss(T=5, H=3, d=64)
    kq, vq = TaSQKeys(cb), TaSQValues(cb)
    pk, pv = kq.encode(x, 0, {}), vq.encode(x, 0, {})
    assert pk["codes"].shape == (5, 30) and pk["scale"].dtype == torch.float16
    assert _payload_bits(pk, {}, 5, 3, 64) == pytest.approx(kq.bits_per_element(3, 64)) == pytest.approx(1.25 + 16 / 192)
    assert _payload_bits(pv, {}, 5, 3, 64) == vq.bits_per_element(3, 64) == 1.25

"""NSNQuant baseline (sglang_tasq.hf.nsnquant) and its universal codebook (calibrate.universal):
the Normalize-Shift-Normalize steps, the Hadamard matrix, the VQ step, reconstruction through the
real HF cache (positions used for keys), exact byte accounting, and a tiny Llama forward."""
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from calibrate import universal
from calibrate.universal import gaussian_codebook
from sglang_tasq.hf.cache import QuantizedKVCache
from sglang_tasq.hf.nsnquant import (NSNKeys, NSNValues, adjust_scale, hadamard, nearest, nsn_normalize,
                                     nsnquant, vq_decode, vq_encode)
from sglang_tasq.rope import apply_rope

H, D, W = 3, 64, 64


@pytest.fixture(scope="module")
def cb1():
    return gaussian_codebook()


@pytest.fixture(scope="module")
def cb2():
    return gaussian_codebook(orthant=True)


def _inv_freq(d=D, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def _tokens(T, h=H, d=D, seed=0, offset=3.0, spread=math.e ** 2):
    """Key/value-like tokens [T, h, d]: a per-(head, channel) offset (``offset * randn``), unit
    Gaussian noise, and token norms spread over a factor ``spread``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, d, generator=g) + offset * torch.randn(1, h, d, generator=g)
    return x * torch.exp(torch.rand(T, h, 1, generator=g) * math.log(spread))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ---- the NSN steps ------------------------------------------------------------------------------
def test_shift_zeroes_the_window_channel_means():
    x = _tokens(2 * W).view(2, W, H, D)
    p = nsn_normalize(x, quantize=False)
    assert torch.allclose(p.x2.mean(dim=1), torch.zeros(2, H, D), atol=1e-5)
    assert not torch.allclose(p.x1.mean(dim=1), torch.zeros(2, H, D), atol=0.1)  # there was a mean to remove
    # quantized: x2 is exactly x1 minus the stored mu, and the stored mu is within half a step of mu
    q = nsn_normalize(x, quantize=True)
    assert torch.equal(q.x2, q.x1 - q.mu_hat[:, None])
    step = q.mu_step.float().repeat_interleave(32, dim=-1)
    assert bool(((q.mu_hat - q.mu).abs() <= step / 2 + 1e-3 * step + 1e-6).all())
    assert bool(((q.s1_hat - q.s1).abs() <= q.s1_step.float()[:, None] * 0.501 + 1e-6).all())


def test_shift_is_taken_before_rope_for_keys():
    """Keys: the residual is turned by RoPE; turned back, its window channel means are 0."""
    x = _tokens(W).view(1, W, H, D)
    pos, inv = torch.arange(W) + 100, _inv_freq()
    p = nsn_normalize(x, positions=pos, inv_freq=inv, quantize=False)
    back = apply_rope(p.x2.view(W, H, D), pos, inv, inverse=True)
    assert torch.allclose(back.mean(dim=0), torch.zeros(H, D), atol=1e-5)
    assert not torch.allclose(p.x2.mean(dim=1), torch.zeros(1, H, D), atol=1e-2)


@pytest.mark.parametrize("quantize", [False, True])
def test_normalize2_gives_unit_rms(quantize):
    x = _tokens(3 * W, seed=1).view(3, W, H, D)
    p = nsn_normalize(x, quantize=quantize)
    rms = p.x3.norm(dim=-1) / math.sqrt(D)
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-5)


def test_nsn_output_looks_standard_normal_unlike_the_raw_data():
    """Large channel offsets (5 randn) and token norms over 100x: after NSN each window's
    channels have mean ~0 and variance ~1 (in aggregate); the raw data is far from that.

    With the stored (4-bit) s1 and mu the residual keeps mu's quantization error as a mean
    (the offset here has 25x the noise's energy, so half a 4-bit step of mu is a fair part of
    the residual): the mean is still cut by an order of magnitude and the second moment is 1."""
    g = torch.Generator().manual_seed(3)
    n = 4
    off = 5 * torch.randn(1, 1, H, D, generator=g)
    norms = torch.exp(torch.rand(n, W, H, 1, generator=g) * math.log(100))
    x = (torch.randn(n, W, H, D, generator=g) + off) * norms

    def stats(t):
        return float(t.mean(dim=1).abs().mean()), float(t.var(dim=1).mean())

    raw_mean, raw_var = stats(x)
    assert raw_mean > 2 and raw_var > 10
    exact = nsn_normalize(x, quantize=False)
    for t in (exact.x3, exact.x3 @ hadamard(D)):  # the Hadamard turn keeps it (orthonormal)
        mean, var = stats(t)
        assert mean < 0.05 and 0.9 < var < 1.1
    y = exact.x3 @ hadamard(D)
    assert abs(float((y.abs() < 1).float().mean()) - 0.6827) < 0.05  # the normal's one-sigma mass
    stored = nsn_normalize(x, quantize=True)
    mean, var = stats(stored.x3)
    assert mean < raw_mean / 8 and 0.7 < var < 1.1
    assert float((stored.x3 ** 2).mean()) == pytest.approx(1.0, abs=1e-5)


# ---- Hadamard -----------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 16, 64, 128])
def test_hadamard_is_orthonormal_symmetric_and_its_own_inverse(d):
    h = hadamard(d)
    assert h.shape == (d, d) and h.dtype == torch.float32
    assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((d, d), 1 / math.sqrt(d)))
    assert bool((h[0] > 0).all()) and float(h.sum()) == pytest.approx(math.sqrt(d), rel=1e-5)  # Sylvester
    y = torch.randn(50, d, generator=torch.Generator().manual_seed(d))
    assert torch.allclose(y @ h @ h, y, atol=1e-5, rtol=0)


def test_hadamard_rejects_non_powers_of_two():
    with pytest.raises(ValueError):
        hadamard(12)


# ---- universal codebook and the VQ step ---------------------------------------------------------
def test_codebooks_shape_and_orthant(cb1, cb2):
    assert cb1.shape == (256, 8) and cb2.shape == (256, 8) and cb1.dtype == torch.float32
    assert bool((cb2 >= 0).all()) and bool((cb1 < 0).any())
    # a k-means codebook of N(0, I_8) at 8 bits: mean squared norm below the data's 8
    assert 4 < float((cb1 * cb1).sum(-1).mean()) < 8


def test_one_bit_vq_round_trips_codewords(cb1):
    assert torch.equal(nearest(cb1, cb1), torch.arange(256))
    g = torch.Generator().manual_seed(0)
    want = torch.randint(0, 256, (5, 4, D // 8), generator=g)  # a y made of codewords
    y = cb1[want].flatten(-2)
    idx, neg = vq_encode(y, cb1, bits=1)
    assert neg is None and torch.equal(idx, want)
    assert torch.equal(vq_decode(idx, None, cb1), y)


def test_two_bit_vq_round_trips_signed_codewords(cb2):
    g = torch.Generator().manual_seed(1)
    want = torch.randint(0, 256, (5, 4, D // 8), generator=g)
    signs = torch.where(torch.rand(5, 4, D, generator=g) < 0.5, -1.0, 1.0)
    y = cb2[want].flatten(-2) * signs
    idx, neg = vq_encode(y, cb2, bits=2)
    assert torch.equal(idx, want) and torch.equal(neg, signs < 0)
    assert torch.equal(vq_decode(idx, neg, cb2), y)


def test_two_bit_nearest_is_the_sign_symmetric_product_codebook_nearest(cb2):
    """sign(y) * P[nearest(|y|)] attains the minimum distance over all 256 x 2^8 signed words."""
    signs = torch.tensor([[1.0 - 2 * ((s >> b) & 1) for b in range(8)] for s in range(256)])
    full = (signs[:, None, :] * cb2[None]).reshape(-1, 8)  # [65536, 8]
    y = torch.randn(1000, 8, generator=torch.Generator().manual_seed(2)) * 1.3
    idx, neg = vq_encode(y, cb2, bits=2)
    ours = ((vq_decode(idx, neg, cb2) - y) ** 2).sum(-1)
    best = torch.cdist(y.double(), full.double()).pow(2).min(-1).values
    assert torch.allclose(ours.double(), best, rtol=1e-5, atol=1e-6)


def test_codebook_is_deterministic_and_seeded():
    args = dict(size=16, dim=8, samples=4096)
    a = gaussian_codebook(seed=5, **args)
    universal._CACHE.clear()  # recompute from scratch
    b = gaussian_codebook(seed=5, **args)
    assert a.numpy().tobytes() == b.numpy().tobytes()
    c = gaussian_codebook(seed=6, **args)
    assert not torch.equal(a, c)
    b.zero_()  # callers get a copy: the cached codebook is unchanged
    assert torch.equal(gaussian_codebook(seed=5, **args), a)


def test_scale_adjust_matches_the_projection():
    y = torch.randn(10, D, generator=torch.Generator().manual_seed(4))
    c = 0.8 * y + 0.1 * torch.randn(10, D, generator=torch.Generator().manual_seed(5))
    s2 = torch.rand(10) + 0.5
    s = adjust_scale(s2, y, c)
    assert torch.allclose(s, s2 * (y * y).sum(-1) / (y * c).sum(-1))
    assert torch.equal(adjust_scale(s2, y, -c), s2)  # <y, c> <= 0: keep s2


@pytest.mark.parametrize("bits", [1, 2])
def test_encode_decode_follow_the_documented_steps(cb1, cb2, bits):
    """The payload and the decoded values are the helpers' steps composed by hand."""
    cb = cb1 if bits == 1 else cb2
    q = NSNValues(cb, bits)
    x = _tokens(2 * W, seed=9)
    pay = q.encode(x, 0, {})
    p = nsn_normalize(x.view(2, W, H, D))
    hd = hadamard(D)
    y = p.x3 @ hd
    idx, neg = vq_encode(y, cb, bits)
    c = vq_decode(idx, neg, cb)
    s2 = adjust_scale(p.s2, y, c).half()
    assert torch.equal(pay["idx"].long(), idx) and torch.equal(pay["s2"], s2)
    assert not torch.equal(s2, p.s2.half())  # the scale adjust changed it
    want = p.s1_hat[..., None] * ((c * s2.float()[..., None]) @ hd + p.mu_hat[:, None])
    assert torch.allclose(q.decode(pay, 0, {}), want.reshape(2 * W, H, D), rtol=1e-5, atol=1e-5)


# ---- reconstruction through the real cache ------------------------------------------------------
def _through_cache(method, T, seed=0):
    """Post-RoPE keys and values [T, H, d] at positions 0..T-1, read back from the cache."""
    inv = _inv_freq()
    k = apply_rope(_tokens(T, seed=seed), torch.arange(T), inv)
    v = _tokens(T, seed=seed + 100)
    cache = QuantizedKVCache(method, sink=0, recent=0, fresh_exact=False)
    kh, vh = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)
    return k, v, kh[0].transpose(0, 1), vh[0].transpose(0, 1), cache


def test_cache_reconstruction_one_and_two_bits(cb1, cb2):
    T, coded = 4 * W + 10, 4 * W  # a partial window stays at full precision
    errs = {}
    for bits, cb in ((1, cb1), (2, cb2)):
        m = nsnquant(cb, _inv_freq(), 1.0, bits)
        assert m.name == ("nsnquant" if bits == 1 else "nsnquant2")
        k, v, kh, vh, _ = _through_cache(m, T)
        assert torch.equal(kh[coded:], k[coded:]) and torch.equal(vh[coded:], v[coded:])
        errs[bits] = (_rel(kh[:coded], k[:coded]), _rel(vh[:coded], v[:coded]))
    (k1, v1), (k2, v2) = errs[1], errs[2]
    assert k1 < 0.35 and v1 < 0.35
    assert k2 < 0.6 * k1 and v2 < 0.6 * v1


def test_keys_use_positions(cb1):
    """Keys at positions shifted by a constant decode (with those positions) to the same error
    and the same pre-RoPE statistics; decoding with wrong positions is worse."""
    T, inv = 2 * W, _inv_freq()
    q = NSNKeys(cb1, inv, 1.0, bits=1)
    pre = _tokens(T, seed=7)
    errs, payloads = {}, {}
    for shift in (0, 1000):
        pos = torch.arange(T) + shift
        k = apply_rope(pre, pos, inv)
        payloads[shift] = p = q.encode(k, 0, {}, positions=pos)
        errs[shift] = _rel(q.decode(p, 0, {}, positions=pos), k)
    assert abs(errs[0] - errs[1000]) < 0.1 * errs[0]
    for name in ("s1_min", "s1_step", "mu_min", "mu_step"):  # un-rotation recovers the same pre-RoPE keys
        assert torch.allclose(payloads[0][name].float(), payloads[1000][name].float(), rtol=2e-3, atol=1e-3)
    k0 = apply_rope(pre, torch.arange(T), inv)
    wrong = _rel(q.decode(payloads[0], 0, {}, positions=torch.arange(T) + 7), k0)
    assert wrong > 2 * errs[0]
    with pytest.raises(ValueError):
        q.encode(k0, 0, {})


def test_values_ignore_positions_and_are_not_positional(cb1):
    q = NSNValues(cb1)
    assert not q.positional and not q.pre_rope and q.block == W and not q.exact
    keys = NSNKeys(cb1, _inv_freq())
    assert keys.positional and not keys.pre_rope and keys.block == W and not keys.exact


# ---- stored bytes -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,h,d", [(1, 3, 64), (2, 3, 64), (1, 2, 32), (2, 1, 8), (1, 2, 128)])
def test_bits_per_element_equals_stored_bytes(cb1, cb2, bits, h, d):
    cb = cb1 if bits == 1 else cb2
    n = 3
    for q in (NSNKeys(cb, _inv_freq(d), 1.0, bits), NSNValues(cb, bits)):
        x = _tokens(n * W, h=h, d=d)
        kw = {"positions": torch.arange(n * W)} if q.positional else {}
        p = q.encode(x, 0, {}, **kw)
        assert all(t.shape[0] == n for t in p.values())
        stored = sum(t.nbytes for t in p.values()) * 8 / (n * W * h * d)
        assert stored == q.bits_per_element(h, d)
        assert q.decode(p, 0, {}, **kw).shape == (n * W, h, d)
    if d == 64:
        g = min(32, d)
        want = (64 * bits + 16 + 4 + 32 / 64 + (4 * d + 32 * d / g) / 64) / d
        assert q.bits_per_element(h, d) == pytest.approx(want) == pytest.approx(1.3984375 + (bits - 1))


# ---- a tiny Llama -------------------------------------------------------------------------------
def test_tiny_llama_forward_and_memory(cb1):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    rot = model.model.rotary_emb
    method = nsnquant(cb1, rot.inv_freq, rot.attention_scaling, bits=1)
    T, h, d = 200, 2, 32
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(0))
    cache = QuantizedKVCache(method, sink=0, recent=0, fresh_exact=False)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
    assert logits.shape == (1, T, 128) and torch.isfinite(logits).all()
    coded = (T // W) * W
    bpe_k, bpe_v = method.bits(h, d)
    payload = (bpe_k + bpe_v) * coded * h * d / 8
    window = 2 * (T - coded) * h * d * 4  # keys and values of the partial window, float32
    assert cache.memory_bytes() == pytest.approx(cfg.num_hidden_layers * (payload + window), abs=0)
    assert cache.memory_breakdown().get("state", 0) == 0  # the codebook is method state, not cache bytes

"""HF cache: same codes and decode as the reference codec, windows, generate() on a tiny Llama."""
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sglang_tasq import codec, packing
from sglang_tasq.hf.baselines import baseline
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import QuantizedKVCache, TaSQCache, unrotate_keys
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks

H, D = 2, 16


def _hf_rotate(k_pre: torch.Tensor, inv_freq: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Pre-RoPE [T, H, d] -> HF post-RoPE [1, H, T, d] (HF's own rotary math, k's dtype)."""
    T = k_pre.shape[0]
    pos = torch.arange(start, start + T)[None]
    freqs = pos[..., None].float() * inv_freq.float()
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(k_pre.dtype), emb.sin().to(k_pre.dtype)
    x = k_pre.transpose(0, 1)[None]
    return apply_rotary_pos_emb(x, x, cos, sin)[1]


def _kv(T, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype)


@pytest.fixture(scope="module")
def cb():
    return random_codebooks(2, H, D, seed=1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_unrotate_recovers_pre_rope(cb, dtype, tol):
    k, _ = _kv(300, dtype=dtype)
    post = _hf_rotate(k, cb.inv_freq)[0].transpose(0, 1)
    back = unrotate_keys(post, torch.arange(300), cb.inv_freq)
    assert torch.allclose(back, k.float(), atol=tol, rtol=tol)


def test_codes_and_decode_match_reference(cb):
    T = 37
    k, v = _kv(T)
    cache = TaSQCache(cb, sink=0, recent=0, fresh_exact=False)
    keys, vals = cache.update(_hf_rotate(k, cb.inv_freq), v.transpose(0, 1)[None], 1)
    layer = cache.layers[1]
    codes, scale = codec.encode_keys(k, cb, 1)
    stored = layer.sides["k"].rows[0].slice(0, T)
    assert torch.equal(stored["codes"], packing.pack_codes(codes.reshape(T, -1), cb.config.code_bits_k))
    assert torch.equal(stored["scale"], scale)
    vcodes = codec.encode_values(v, cb, 1)
    assert torch.equal(layer.sides["v"].rows[0].slice(0, T)["codes"],
                       packing.pack_codes(vcodes.reshape(T, -1), cb.config.code_bits_v))
    want_k = apply_rope(codec.decode_keys(codes, scale, cb, 1), torch.arange(T), cb.inv_freq, cb.attention_scaling)
    assert torch.equal(keys[0].transpose(0, 1), want_k)
    assert torch.equal(vals[0].transpose(0, 1), codec.decode_values(vcodes, cb, 1))


def _expected(cb, k, v, T, sink, recent):
    """Per token: fp inside [0, sink) or [T - recent, T), decoded + RoPE outside."""
    codes, scale = codec.encode_keys(k[:T], cb, 0)
    dk = apply_rope(codec.decode_keys(codes, scale, cb, 0), torch.arange(T), cb.inv_freq)
    dv = codec.decode_values(codec.encode_values(v[:T], cb, 0), cb, 0)
    post = _hf_rotate(k[:T], cb.inv_freq)[0].transpose(0, 1)
    fp = (torch.arange(T) < sink) | (torch.arange(T) >= T - recent)
    return torch.where(fp[:, None, None], post, dk), torch.where(fp[:, None, None], v[:T], dv)


@pytest.mark.parametrize("sink,recent", [(3, 5), (0, 0), (4, 0), (0, 7), (50, 50)])
def test_windows_prefill_then_decode_steps(cb, sink, recent):
    k, v = _kv(30)
    cache = TaSQCache(cb, sink=sink, recent=recent, fresh_exact=False)
    post = _hf_rotate(k, cb.inv_freq)
    vv = v.transpose(0, 1)[None]
    T = 17
    keys, vals = cache.update(post[:, :, :T], vv[:, :, :T], 0)
    for t in range(T, 31):
        ek, ev = _expected(cb, k, v, t, sink, recent)
        assert torch.equal(keys[0].transpose(0, 1), ek), t
        assert torch.equal(vals[0].transpose(0, 1), ev), t
        if t < 30:
            keys, vals = cache.update(post[:, :, t : t + 1], vv[:, :, t : t + 1], 0)
    assert cache.get_seq_length() == 30


def test_windows_default_to_the_artifacts(cb):
    """An artifact whose windows ``calibrate serving --sink/--recent`` set is read with those
    windows, as its server keeps them; explicit ints override."""
    served = random_codebooks(2, H, D, seed=1, config=TaSQConfig(codebook_size_k=64, codebook_size_v=64,
                                                                 sink_window=3, recent_window=5))
    k, v = _kv(30)
    post, vv = _hf_rotate(k, cb.inv_freq), v.transpose(0, 1)[None]
    cache = TaSQCache(served, fresh_exact=False)
    assert (cache.sink, cache.recent) == (3, 5)
    keys, vals = cache.update(post, vv, 0)
    ek, ev = _expected(cb, k, v, 30, 3, 5)
    assert torch.equal(keys[0].transpose(0, 1), ek) and torch.equal(vals[0].transpose(0, 1), ev)
    assert (TaSQCache(served, sink=0, recent=7).sink, TaSQCache(served, sink=0, recent=7).recent) == (0, 7)
    assert (TaSQCache(cb).sink, TaSQCache(cb).recent) == (64, 256)  # the config's defaults


def test_fresh_exact_prefill_then_read_from_codes(cb):
    k, v = _kv(21)
    cache = TaSQCache(cb, sink=2, recent=4)  # fresh_exact=True: the inserting call sees fp
    post, vv = _hf_rotate(k, cb.inv_freq), v.transpose(0, 1)[None]
    keys, vals = cache.update(post[:, :, :20], vv[:, :, :20], 0)
    assert torch.equal(keys, post[:, :, :20]) and torch.equal(vals, vv[:, :, :20])
    keys, vals = cache.update(post[:, :, 20:], vv[:, :, 20:], 0)
    ek, ev = _expected(cb, k, v, 21, 2, 4)
    assert torch.equal(keys[0].transpose(0, 1), ek) and torch.equal(vals[0].transpose(0, 1), ev)


def test_kivi_residual_stays_full_precision():
    k, v = _kv(40)
    cache = QuantizedKVCache(baseline("kivi2"), sink=0, recent=0, fresh_exact=False)
    vv = v.transpose(0, 1)[None]
    kk = k.transpose(0, 1)[None]
    keys, vals = cache.update(kk, vv, 0)
    assert torch.equal(keys[:, :, 32:], kk[:, :, 32:]) and torch.equal(vals[:, :, 32:], vv[:, :, 32:])
    assert not torch.equal(keys[:, :, :32], kk[:, :, :32])
    assert (keys[:, :, :32] - kk[:, :, :32]).abs().max() < 1.5


def test_memory_accounting(cb):
    k, v = _kv(30)
    cache = TaSQCache(cb, sink=3, recent=5)
    cache.update(_hf_rotate(k, cb.inv_freq), v.transpose(0, 1)[None], 0)
    row_k = packing.packed_row_bytes(H * D // 8, cb.config.code_bits_k)
    row_v = packing.packed_row_bytes(H * D // 8, cb.config.code_bits_v)
    b = cache.memory_breakdown()
    assert b["codes"] == 30 * (row_k + row_v) and b["scale"] == 30 * 2
    assert b["window"] == 2 * (3 + 5) * H * D * 4  # fp32 test tensors: 4 bytes/element
    assert cache.memory_bytes(windows=False) == 30 * (row_k + row_v + 2)
    assert cache.bytes_per_token() == pytest.approx(cache.memory_bytes() / 30)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def _generate(model, cache, ids, n=8):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("keys,values", [(True, True), (True, False), (False, True)])
def test_tiny_llama_generate_finite(keys, values):
    model = _tiny_llama()
    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=64, codebook_size_v=64))
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    cache = TaSQCache(cb, sink=4, recent=8, keys=keys, values=values)
    seq, scores = _generate(model, cache, ids)
    assert seq.shape == (1, 58) and torch.isfinite(scores).all()
    assert cache.get_seq_length() == 57
    logits = model(ids, past_key_values=TaSQCache(cb, 4, 8, fresh_exact=False)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_method_identical_to_dynamic_cache(dtype):
    model = _tiny_llama().to(dtype)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    seq_ref, sc_ref = _generate(model, DynamicCache(), ids)
    seq, sc = _generate(model, QuantizedKVCache(baseline("bf16"), sink=4, recent=8), ids)
    assert torch.equal(seq, seq_ref) and torch.equal(sc, sc_ref)


@pytest.mark.parametrize("name", ["fp8_e4m3", "kivi2"])
def test_baselines_generate(name):
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    _, sc = _generate(model, QuantizedKVCache(baseline(name), sink=0, recent=0), ids)
    _, ref = _generate(model, DynamicCache(), ids)
    assert torch.isfinite(sc).all()
    assert torch.equal(sc[0], ref[0])  # fresh_exact: the prefill itself attends at full precision
    assert not torch.equal(sc[1:], ref[1:])  # later steps read the quantized cache

"""The reference codec: packing, encode/decode consistency, folded decode, RoPE layout."""
import pytest
import torch

from sglang_tasq import codec, packing
from sglang_tasq.config import TaSQConfig
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks


@pytest.mark.parametrize("n,bits", [(1, 10), (17, 10), (24, 10), (3, 8), (7, 12), (5, 1), (9, 16)])
def test_pack_unpack_round_trip(n, bits):
    torch.manual_seed(n * bits)
    codes = torch.randint(0, 1 << bits, (13, n))
    codes[0] = (1 << bits) - 1  # maximum code value
    packed = packing.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (13, (n * bits + 7) // 8)
    assert torch.equal(packing.unpack_codes(packed, n, bits), codes)


def test_pack_layout_is_little_endian_bit_stream():
    codes = torch.tensor([[0x3FF, 0x001]])  # two 10-bit codes: bits 0-9 set, then bit 10 set
    packed = packing.pack_codes(codes, 10)
    assert packed.tolist() == [[0xFF, 0x07, 0x00]]
    with pytest.raises(ValueError):
        packing.pack_codes(torch.tensor([[1024]]), 10)


def test_10bit_codes_use_minimum_bytes():
    # SmolLM2: 3 KV heads x 8 groups of 10-bit codes per token = 30 bytes, not 48 (uint16)
    assert packing.packed_row_bytes(24, 10) == 30


def _brute_nearest(x, cb):
    d = ((x[:, :, :, None, :] - cb[None]) ** 2).sum(-1)
    return d.argmin(-1)


@pytest.mark.parametrize("scale", ["shared", "per_head", "none"])
def test_encode_picks_nearest_tailored_codeword(scale):
    cb = random_codebooks(2, 3, 16, TaSQConfig(codebook_size_k=32, codebook_size_v=32, scale=scale), seed=1)
    k = torch.randn(11, 3, 16) * 4
    codes, s = codec.encode_keys(k, cb, 1)
    x, s2 = codec.key_tailor(k, cb, 1)
    assert torch.equal(codes, _brute_nearest(x, cb.tailored_k_codebook(1)))
    if scale == "shared":
        assert s.dtype == torch.float16 and s.shape == (11,)
        xw = k * cb.k_weight[1]
        torch.testing.assert_close(s.float(), xw.pow(2).mean((1, 2)).sqrt(), rtol=1e-3, atol=1e-3)
    elif scale == "none":
        assert s is None


def test_decode_is_exact_for_codewords():
    """Keys built from codewords decode exactly: folding and un-permutation are consistent."""
    cfg = TaSQConfig(codebook_size_k=16, codebook_size_v=16, scale="none")
    cb = random_codebooks(1, 2, 16, cfg, seed=3)
    codes = torch.randint(0, 16, (7, 2, 16 // cfg.group_size_k))
    k = codec.decode_keys(codes, None, cb, 0)
    codes2, _ = codec.encode_keys(k, cb, 0)
    assert torch.equal(codes2, codes)
    torch.testing.assert_close(codec.decode_keys(codes2, None, cb, 0), k)


def test_rope_in_permuted_space_equals_rope_in_native_space():
    cb = random_codebooks(1, 2, 32, TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=4)
    codes = torch.randint(0, 16, (9, 2, 4))
    s = (torch.rand(9) + 0.5).half()
    pos = torch.tensor([0, 1, 5, 97, 1000, 4095, 8191, 60000, 3])
    native = apply_rope(codec.decode_keys(codes, s, cb, 0), pos, cb.inv_freq)
    permuted = codec.rope_permuted(codec.decode_keys_permuted(codes, s, cb, 0), pos, cb, 0)
    inv = cb.k_inv_perm(0).expand(9, 2, 32)
    torch.testing.assert_close(torch.gather(permuted, 2, inv), native, rtol=1e-5, atol=1e-5)


def test_attention_over_codes_matches_dense_attention_on_decoded_keys():
    cb = random_codebooks(1, 2, 16, seed=5)
    S = 13
    k = torch.randn(S, 2, 16)
    v = torch.randn(S, 2, 16)
    kc, ks = codec.encode_keys(k, cb, 0)
    vc = codec.encode_values(v, cb, 0)
    pos = torch.arange(S)
    q = torch.randn(3, 4, 16)
    qpos = torch.tensor([4, 9, 12])
    full = torch.zeros(S, dtype=torch.bool)
    full[:2] = True
    out = codec.attention_over_codes(q, qpos, kc, ks, vc, pos, cb, 0, 0.25, k_full=k, v_full=v, full_mask=full)
    kd = codec.decode_keys(kc, ks, cb, 0)
    kd[:2] = k[:2]
    vd = codec.decode_values(vc, cb, 0)
    vd[:2] = v[:2]
    ref = codec.attention_dense(q, qpos, apply_rope(kd, pos, cb.inv_freq), vd, pos, 0.25)
    torch.testing.assert_close(out, ref)
    assert out.shape == (3, 4, 16)

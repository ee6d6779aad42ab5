"""Key scales shared by groups of KV heads (``TaSQConfig.scale_groups``, what a TP-N artifact
holds): the reference codec's definition, its bit accounting, the Numba pool encoder against
it, and the head slices a tensor-parallel rank serves (``sglang_tasq.sharding``)."""
import dataclasses

import pytest
import torch

from numba_kernels import cpu
from sglang_tasq import codec, packing, sharding
from sglang_tasq.config import ConfigError, TaSQConfig
from sglang_tasq.rope import apply_rope, cos_sin
from sglang_tasq.testing import random_codebooks


def _cfg(**kw):
    return TaSQConfig(codebook_size_k=64, codebook_size_v=32, group_size_k=4, group_size_v=8, **kw)


def test_group_scales_are_each_groups_rms():
    """G groups of H/G heads: each token's scale is the RMS of its group's weighted keys; one
    group is the paper's shared scale and H groups the per-head scale, to the bit."""
    H, d, T = 4, 16, 9
    k = torch.randn(T, H, d) * torch.tensor([1.0, 5.0, 0.2, 3.0]).view(1, H, 1)
    cb2 = random_codebooks(1, H, d, _cfg(scale_groups=2), seed=3)
    x, s = codec.key_tailor(k, cb2, 0)
    kw = k * cb2.k_weight[0]
    want = torch.stack([kw[:, :2].pow(2).mean((1, 2)), kw[:, 2:].pow(2).mean((1, 2))], 1).sqrt().half()
    assert s.shape == (T, 2) and torch.equal(s, want)
    # the tailored keys of each group have unit RMS (up to the fp16 rounding of the scale)
    xr = x.reshape(T, 2, -1).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(xr, torch.ones(T, 2), rtol=2e-3, atol=0)
    for groups, other in ((1, "shared"), (H, "per_head")):
        a = codec.key_tailor(k, dataclasses.replace(cb2, config=_cfg(scale_groups=groups)), 0)
        b = codec.key_tailor(k, dataclasses.replace(cb2, config=_cfg(scale=other)), 0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].reshape(b[1].shape), b[1])
    # decode spreads each group's scale over its heads
    codes = codec.nearest_codeword(x, cb2.tailored_k_codebook(0))
    dec = codec.decode_keys(codes, s, cb2, 0)
    per = codec.decode_keys(codes, s.repeat_interleave(2, 1), dataclasses.replace(cb2, config=_cfg(scale="per_head")), 0)
    assert torch.equal(dec, per)


def test_group_scales_config_and_bits():
    cfg = _cfg(scale_groups=2)
    assert packing.scales_per_token(cfg, 4) == 2 and packing.row_bytes(cfg, 4, 16)[1] == 4
    assert cfg.bits_k(4, 16) == pytest.approx(6 / 4 + 32 / 64)
    assert cfg.heads_per_scale(4) == 2 and _cfg().heads_per_scale(4) == 4 and _cfg(scale="per_head").heads_per_scale(4) == 1
    with pytest.raises(ConfigError, match="scale_groups=2 with scale='per_head'"):
        _cfg(scale="per_head", scale_groups=2)
    with pytest.raises(ConfigError, match="scale_groups=0"):
        _cfg(scale_groups=0)
    with pytest.raises(ConfigError, match="does not divide the model's 3 KV heads"):
        _cfg(scale_groups=2).check_kv_heads(3)


@pytest.mark.parametrize("T", [5, 300])  # a decode step (one serial call) and the batched kernels
def test_pool_encoder_writes_group_scales_as_the_reference(T):
    H, d = 4, 16
    cfg = _cfg(scale_groups=2)
    cb = random_codebooks(2, H, d, cfg, seed=7)
    gen = torch.Generator().manual_seed(T)
    positions = torch.randint(0, 900, (T,), generator=gen)
    k_post = (torch.randn(T, H, d, generator=gen) * torch.tensor([1.0, 4.0, 0.3, 2.0]).view(1, H, 1)).to(torch.bfloat16)
    v = torch.randn(T, H, d, generator=gen).to(torch.bfloat16)
    kb, sb, vb = packing.row_bytes(cfg, H, d)
    k_rows = torch.zeros(T + 3, kb + sb, dtype=torch.uint8)
    v_rows = torch.zeros(T + 3, vb, dtype=torch.uint8)
    loc = torch.randperm(T + 2, generator=gen)[:T] + 1
    cos, sin = cos_sin(torch.arange(1024), cb.inv_freq, cb.attention_scaling)
    assert cpu.PoolEncoder(cb).encode_into(1, k_post, v, positions, cos, sin, loc, k_rows, v_rows, kb)
    k_pre = apply_rope(k_post.float(), positions, cb.inv_freq, cb.attention_scaling, inverse=True)
    codes, scale = codec.encode_keys(k_pre, cb, 1)
    want = torch.cat([packing.pack_codes(codes.reshape(T, -1), cfg.code_bits_k), scale.contiguous().view(torch.uint8)], 1)
    got = k_rows[loc]
    # equal but at float near-ties (the fused kernel un-rotates and sums in its own order)
    assert (got[:, kb:] == want[:, kb:]).all(1).float().mean() >= 0.97
    assert (got == want).all(1).float().mean() >= 0.9
    got_scale = got[:, kb:].contiguous().view(torch.float16).float()
    torch.testing.assert_close(got_scale, scale.float(), rtol=1e-3, atol=0)


def test_rank_heads_follow_sglangs_split():
    assert [sharding.rank_heads(4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [sharding.rank_heads(3, r, 3) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    # tp > H: one head per rank, each replicated tp / H times
    assert [sharding.rank_heads(2, r, 4) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(sharding.ShardingError, match="--tp 2 does not divide the model's 3 KV heads"):
        sharding.rank_heads(3, 0, 2)
    with pytest.raises(sharding.ShardingError, match="cannot be replicated evenly"):
        sharding.rank_heads(2, 0, 3)


def test_tp_degrees_an_artifact_serves():
    H = 4
    assert sharding.check_tp(_cfg(scale_groups=2), H, 2) == 1  # each rank: one whole group
    assert sharding.check_tp(_cfg(scale_groups=4), H, 2) == 2  # each rank: two groups
    assert sharding.check_tp(_cfg(scale_groups=2), H, 1) == 2  # TP 1 serves any grouping
    assert sharding.check_tp(_cfg(scale="per_head"), H, 4) == 1
    assert sharding.check_tp(_cfg(scale="none"), H, 2) == 0
    with pytest.raises(sharding.ShardingError, match=r"shares one key scale over 4 KV heads .* --tp 2"):
        sharding.check_tp(_cfg(), H, 2)
    with pytest.raises(sharding.ShardingError, match=r"over 2 KV heads .* a rank holds 1"):
        sharding.check_tp(_cfg(scale_groups=2), H, 4)


def test_a_rank_slice_codes_its_heads_as_the_whole_model_does():
    """Each rank's artifact slice, run on its heads only, gives the full artifact's codes and
    scales for those heads: sharding loses nothing and needs no communication."""
    from sglang_tasq.artifact import Artifact, ModelFingerprint

    H, d, T = 4, 16, 21
    cb = random_codebooks(2, H, d, _cfg(scale_groups=2), seed=5)
    fp = ModelFingerprint("LlamaForCausalLM", 2, 8, H, d, 10000.0, None)
    art = Artifact(manifest={"model": fp.to_dict(), "config": cb.config.to_dict()}, codebooks=cb, path=None)
    k = torch.randn(T, H, d) * 3
    codes, scale = codec.encode_keys(k, cb, 1)
    vcodes = codec.encode_values(k, cb, 1)
    for r in range(2):
        part = sharding.shard(art, r, 2)
        sl = slice(2 * r, 2 * r + 2)
        assert part.model.num_kv_heads == 2 and part.model.num_q_heads == 4 and part.config.scale_groups == 1
        assert part.manifest["tp"] == {"rank": r, "size": 2, "kv_heads": [2 * r, 2 * r + 2]}
        c, s = codec.encode_keys(k[:, sl], part.codebooks, 1)
        assert torch.equal(c, codes[:, sl]) and torch.equal(s, scale[:, r])
        assert torch.equal(codec.encode_values(k[:, sl], part.codebooks, 1), vcodes[:, sl])
        assert torch.equal(codec.decode_keys(c, s, part.codebooks, 1), codec.decode_keys(codes, scale, cb, 1)[:, sl])
    assert sharding.shard(art, 0, 1) is art
    with pytest.raises(sharding.ShardingError, match="a rank holds 1"):
        sharding.shard(art, 0, 4)


def test_cuda_tables_refuse_partial_scale_groups():
    """The CUDA kernels take one scale per token or one per head; a rank's slice is one of those
    (``sharding.shard`` writes one group per head as per_head), anything else is refused."""
    from numba_kernels.tables import LayerTables

    with pytest.raises(ValueError, match="scale_groups=2: the CUDA kernels"):
        LayerTables.from_codebooks(random_codebooks(1, 4, 16, _cfg(scale_groups=2)), 0)
    cb = random_codebooks(1, 3, 16, _cfg(scale_groups=3))
    from sglang_tasq.artifact import Artifact, ModelFingerprint

    fp = ModelFingerprint("LlamaForCausalLM", 1, 9, 3, 16, 10000.0, None)
    art = sharding.shard(Artifact(manifest={"model": fp.to_dict(), "config": cb.config.to_dict()}, codebooks=cb,
                                  path=None), 0, 1)
    assert art.config.scale == "per_head" and art.config.scale_groups == 1
    LayerTables.from_codebooks(art.codebooks, 0)

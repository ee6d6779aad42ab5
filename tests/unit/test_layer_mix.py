"""Layer-adaptive rate (issue 14 item 2): the per-layer mix of two artifacts, its method names,
and the retrieval-head copy score that picks the layers."""
import pytest
import torch

from bench import methods as M
from bench.retrieval import Point
from bench.retrieval_heads import copy_step, layer_ranking
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.baselines import Identity
from sglang_tasq.hf.cache import PerLayer, TaSQKeys, TaSQValues
from sglang_tasq.testing import random_codebooks

L, H, D = 4, 2, 16


def _sides(seed, cfg):
    cb = random_codebooks(L, H, D, config=cfg, seed=seed)
    return TaSQKeys(cb), TaSQValues(cb)


def test_mix_codes_each_layer_with_its_artifact():
    lo = _sides(0, TaSQConfig(codebook_size_k=64, codebook_size_v=64))
    hi = _sides(1, TaSQConfig(group_size_k=4, codebook_size_k=16, codebook_size_v=64))
    x = torch.randn(5, H, D)
    for side in (0, 1):
        mix = PerLayer(lo[side], hi[side], [1, 3], L)
        for layer in range(L):
            want = (hi if layer in (1, 3) else lo)[side]
            other = (lo if layer in (1, 3) else hi)[side]
            got = mix.decode(mix.encode(x, layer, {}), layer, {})
            assert torch.equal(got, want.decode(want.encode(x, layer, {}), layer, {}))
            assert not torch.equal(got, other.decode(other.encode(x, layer, {}), layer, {}))
    mix = PerLayer(lo[0], hi[0], [1, 3], L)
    b_lo, b_hi = lo[0].bits_per_element(H, D), hi[0].bits_per_element(H, D)
    assert b_hi != b_lo
    assert mix.bits_per_element(H, D) == pytest.approx((2 * b_lo + 2 * b_hi) / 4)
    assert mix.pre_rope and mix.inv_freq is lo[0].inv_freq


def test_mix_refuses_bad_layers_and_unlike_sides():
    k, v = _sides(0, TaSQConfig(codebook_size_k=64, codebook_size_v=64))
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        PerLayer(k, k, [4], L)
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        PerLayer(k, k, [], L)
    with pytest.raises(ValueError, match="pre_rope"):
        PerLayer(k, Identity(), [0], L)  # pre-RoPE keys against keys stored as cached


def test_mix_names():
    spec = M.parse("tasq+tasq@g4k256/g8k1024@L3,7,12")
    assert isinstance(spec, M.MixSpec) and spec.layers == (3, 7, 12)
    assert spec.base.artifact_name == "tasq" and spec.hi.artifact_name == "tasq_g4k256_g8k1024"
    assert M.parse("tasq@g8k256/g8k1024+tasq@g4k256/g8k1024@L0").base.artifact_name == "tasq_g8k256_g8k1024"
    p = Point.parse("tasq+tasq@g4k256/g8k1024@L3,7:64+256")
    assert p.method == "tasq+tasq@g4k256/g8k1024@L3,7" and p.slug == "tasq_tasq_g4k256_g8k1024_L3_7_64_256"
    for bad, why in (("tasq+tasq@g4k256@L7,3", "increasing"), ("tasq+tasq@g4k256@L3,3", "once"),
                     ("tasq+cq@L1", "not a calibrated TaSQ"), ("tasq+tasq_keys_only@L1", "not a calibrated TaSQ")):
        with pytest.raises(ValueError, match=why):
            M.parse(bad)
    with pytest.raises(ValueError, match="prepare"):
        M.build(spec)


def test_copy_step_counts_only_the_copied_needle_token():
    prompt = torch.tensor([5, 9, 7, 9, 3])  # needle value tokens at 1, 2 (9, 7); 3 is a 9 outside it
    needle = {1, 2}
    attn = torch.zeros(2, 3, 7)  # 2 layers, 3 heads, 5 prompt + 2 answer positions
    attn[0, 0, 1] = 1.0  # top-1 on the needle's 9: a copy of target 9
    attn[0, 1, 3] = 1.0  # a 9, but outside the needle
    attn[0, 2, 2] = 1.0  # on the needle, but a 7
    attn[1, 0, 6] = 1.0  # on a generated position
    attn[1, 1, [1, 3]] = 1.0  # tie between the needle's 9 and the other 9: the first wins
    attn[1, 2, [3, 1]] = 0.5
    got = copy_step(attn, 9, prompt, needle)
    assert got.tolist() == [[True, False, False], [False, True, True]]
    assert copy_step(attn, 7, prompt, needle).tolist() == [[False, False, True], [False, False, False]]


def test_layer_ranking_sums_heads_and_breaks_ties_low():
    scores = [[0.1, 0.1], [0.5, 0.0], [0.0, 0.2], [0.3, 0.2]]
    assert layer_ranking(scores, 2) == [1, 3]
    assert layer_ranking(scores, 4) == [1, 3, 0, 2]


def test_prepare_reads_both_artifacts_and_refuses_unlike_depths(tmp_path):
    from sglang_tasq.artifact import ModelFingerprint, save_artifact

    def fp(layers):
        return ModelFingerprint("LlamaForCausalLM", num_layers=layers, num_q_heads=4, num_kv_heads=H, head_dim=D,
                                rope_theta=10000.0, rope_scaling=None)

    calib = {"corpus": "test", "tokens": 0, "seed": 0, "wall_time_s": 0.0}
    lo = save_artifact(tmp_path / "lo", random_codebooks(L, H, D, TaSQConfig(codebook_size_k=64, codebook_size_v=64)),
                       fp(L), calib).parent
    hi_cfg = TaSQConfig(group_size_k=4, codebook_size_k=16, codebook_size_v=64)
    hi = save_artifact(tmp_path / "hi", random_codebooks(L, H, D, hi_cfg, seed=1), fp(L), calib).parent
    spec = M.parse("tasq@g8k64+tasq@g4k16/g8k64@L1,3")
    over = {"tasq_g8k64": str(lo), "tasq_g4k16_g8k64": str(hi)}
    method, arts = M.prepare(spec, "unused", "default", tmp_path, over, fp(L))
    assert {k: str(v) for k, v in arts.items()} == over
    kb = [M.bits(M.prepare(M.parse(n), "unused", "default", tmp_path, over, fp(L))[0], H, D)[0]
          for n in ("tasq@g8k64", "tasq@g4k16/g8k64")]
    assert M.bits(method, H, D)[0] == pytest.approx((kb[0] + kb[1]) / 2, abs=1e-4)
    deep = save_artifact(tmp_path / "deep", random_codebooks(L + 1, H, D, hi_cfg, seed=1), fp(L + 1), calib).parent
    with pytest.raises(ValueError, match="4 and 5 layers"):
        M.prepare(spec, "unused", "default", tmp_path, {**over, "tasq_g4k16_g8k64": str(deep)}, None)

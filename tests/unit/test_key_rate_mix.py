"""A per-layer key rate in one artifact (``calibrate --mix-layers``, config ``mix_layers``): the fit,
the file format and its checks, the HF cache, and the bench's use of it for a layer mix."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from bench import methods as M
from calibrate import pipeline
from calibrate.cli import build_config, _calibrate_parser
from sglang_tasq import codec, sharding
from sglang_tasq.artifact import ArtifactError, ModelFingerprint, load_artifact, save_artifact
from sglang_tasq.config import ConfigError, TaSQConfig
from sglang_tasq.hf.cache import PerLayer, TaSQKeys, TaSQValues
from sglang_tasq.testing import random_codebooks

L, H, D, W = 3, 2, 16, 64
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
FP = ModelFingerprint("LlamaForCausalLM", num_layers=L, num_q_heads=2 * H, num_kv_heads=H, head_dim=D,
                      rope_theta=10000.0, rope_scaling=None)
SMALL = dict(codebook_size_k=32, codebook_size_v=16, group_size_v=4, max_kmeans_samples=256, kmeans_iters=4,
             window_len=W, fisher_tokens=W * 2)


def _prepared():
    """A synthetic capture of L layers (correlated channels, a Fisher pass on half the tokens)."""
    gen = torch.Generator().manual_seed(3)
    N = W * 4
    mix = torch.randn(L, 1, H, D, D, generator=gen) / D ** 0.5
    keys = torch.einsum("lnhd,lxhed->lnhe", torch.randn(L, N, H, D, generator=gen), mix).half()
    values = torch.randn(L, N, H, D, generator=gen).half()
    cap = SimpleNamespace(keys=keys, values=values, fisher_k=torch.rand(L, N // 2, H, D, generator=gen),
                          fisher_v=torch.rand(L, N // 2, H, D, generator=gen), q_dense_sums=None, q_post_sums=None,
                          q_diag_sums=torch.rand(L, H, D, generator=gen) + 0.5, q_pair_count=1, tokens=N, loss=0.0)
    ev = SimpleNamespace(keys=keys, values=values, queries=torch.randn(L, N, 2 * H, D, generator=gen).half(), tokens=N)
    return pipeline.Prepared(FP, "none", "test", INV_FREQ, 1.0, cap, ev, W, {})


def _fit(cfg):
    return pipeline.fit(_prepared(), cfg, progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def fits():
    base = TaSQConfig(group_size_k=8, **SMALL)
    hi = dataclasses.replace(base, group_size_k=4, codebook_size_k=16)
    mixed = dataclasses.replace(base, mix_layers=(1,), mix_group_size_k=4, mix_codebook_size_k=16)
    return _fit(base), _fit(hi), _fit(mixed)


def test_mixed_fit_is_each_layer_of_the_uniform_fits(fits):
    """One capture, one seed: a mixed calibration's layer l is the uniform fit's layer l at l's rate
    (the draws do not depend on the rate), values included."""
    base, hi, mixed = (f.codebooks for f in fits)
    assert mixed.layer_mixed and not base.layer_mixed
    for l in range(L):
        src = hi if l == 1 else base
        assert torch.equal(mixed.k_codebook[l], src.k_codebook[l])
        assert torch.equal(mixed.k_perm[l], src.k_perm[l])
        assert mixed.key_group_size(l) == (4 if l == 1 else 8)
    assert torch.equal(mixed.v_codebook, base.v_codebook) and torch.equal(mixed.k_weight, base.k_weight)
    assert mixed.pairs_in_groups
    # the held-out error of the mixed layer is the high-rate fit's
    assert fits[2].errors["per_layer"][1] == fits[1].errors["per_layer"][1]
    assert fits[2].errors["per_layer"][0] == fits[0].errors["per_layer"][0]


def test_round_trip_and_hf_cache_equal_the_two_artifact_mix(tmp_path, fits):
    base, hi, mixed = fits
    path = pipeline.write(mixed, tmp_path / "mixed")
    man = json.loads(path.read_text())
    cfg = mixed.codebooks.config
    assert man["config"]["mix_layers"] == [1]
    want_bits = (2 * (5 / 8) + 4 / 4) / 3 + 16 / (H * D)  # 32 codewords / 8 dims, 16 / 4 dims, one fp16 scale
    assert man["bits_k"] == pytest.approx(want_bits, abs=1e-6) == cfg.bits_k_mean(H, D, L)
    art = load_artifact(path, model=FP)
    assert art.config == cfg
    for l in range(L):
        assert torch.equal(art.codebooks.k_codebook[l], mixed.codebooks.k_codebook[l])
    one = (TaSQKeys(art.codebooks), TaSQValues(art.codebooks))
    two = [PerLayer(s(base.codebooks), s(hi.codebooks), [1], L) for s in (TaSQKeys, TaSQValues)]
    x = torch.randn(9, H, D)
    for side in (0, 1):
        for l in range(L):
            p1, p2 = one[side].encode(x, l, {}), two[side].encode(x, l, {})
            assert torch.equal(p1["codes"], p2["codes"])
            assert torch.equal(one[side].decode(p1, l, {}), two[side].decode(p2, l, {}))
        assert one[side].bits_per_element(H, D) == pytest.approx(two[side].bits_per_element(H, D))
    # the reference codec reads the per-layer form: encode, RoPE in the permuted layout, decode
    codes, scale = codec.encode_keys(x, art.codebooks, 1)
    assert codes.shape == (9, H, D // 4)
    kp = codec.decode_keys_permuted(codes, scale, art.codebooks, 1)
    pos = torch.arange(9)
    back = codec.rope_permuted(codec.rope_permuted(kp, pos, art.codebooks, 1), pos, art.codebooks, 1, inverse=True)
    torch.testing.assert_close(back, kp, atol=1e-5, rtol=0)


def test_artifact_checks_name_the_field(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, mix_layers=(0, 2), mix_codebook_size_k=16)
    cb = random_codebooks(L, H, D, config=cfg, seed=1)
    path = save_artifact(tmp_path / "a", cb, FP, calibration={"kind": "random"})
    assert load_artifact(path).codebooks.key_group_size(2) == 4
    # the TP slice keeps the per-layer form
    half = sharding.shard_codebooks(cb, range(0, 1), 1)
    assert half.k_codebook[0].shape == (1, 4, 16, 4) and half.k_codebook[1].shape == (1, 2, 64, 8)

    def rewrite(edit_tensors=None, edit_manifest=None):
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        t = load_file(str(path.parent / "tasq.safetensors"))
        if edit_tensors:
            edit_tensors(t)
        save_file(t, str(out / "tasq.safetensors"))
        man = json.loads(path.read_text())
        data = (out / "tasq.safetensors").read_bytes()
        import hashlib
        man["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        if edit_manifest:
            edit_manifest(man)
        (out / "tasq.json").write_text(json.dumps(man))
        return out

    with pytest.raises(ArtifactError, match=r"tensor k.codebook.mix: missing"):
        load_artifact(rewrite(lambda t: t.pop("k.codebook.mix")))
    with pytest.raises(ArtifactError, match=r"tensor k.codebook.mix: shape \(2, 2, 4, 16, 4\), expected \(2, 2, 4, 32, 4\)"):
        load_artifact(rewrite(edit_manifest=lambda m: m["config"].update(mix_codebook_size_k=32)
                              or m.update(bits_k=TaSQConfig(**{**m["config"]}).bits_k_mean(H, D, L))))
    with pytest.raises(ArtifactError, match=r"tensor k.codebook: shape \(1, "):
        load_artifact(rewrite(edit_manifest=lambda m: m["config"].update(mix_layers=[2])
                              or m.update(bits_k=TaSQConfig(**{**m["config"]}).bits_k_mean(H, D, L))))
    with pytest.raises(ArtifactError, match=r"k.codebook.mix: present, but config.mix_layers is empty"):
        load_artifact(rewrite(edit_manifest=lambda m: m["config"].update(mix_layers=[])
                              or m.update(bits_k=TaSQConfig(**{**m["config"]}).bits_k(H, D))))
    with pytest.raises(ArtifactError, match=r"config: mix_layers \[3\]: the model has layers 0..2"):
        load_artifact(rewrite(edit_manifest=lambda m: m["config"].update(mix_layers=[0, 3])))
    with pytest.raises(ArtifactError, match=r"bits_k: manifest says"):
        load_artifact(rewrite(edit_manifest=lambda m: m.update(bits_k=cfg.bits_k(H, D))))
    with pytest.raises(ArtifactError, match=r"layer 2 head 0 group 0 splits a RoPE pair"):
        load_artifact(rewrite(lambda t: t["k.perm"][2, 0].copy_(torch.arange(D, dtype=t["k.perm"].dtype))))


@pytest.mark.parametrize("kw,needle", [
    (dict(mix_layers=(2, 1)), "increasing order"), (dict(mix_layers=(1, 1)), "each layer once"),
    (dict(mix_layers=(1,), mix_group_size_k=8, mix_codebook_size_k=1024), "the same key rate"),
    (dict(mix_layers=(1,), mix_group_size_k=3), "power of two"),
    (dict(mix_layers=(1,), mix_codebook_size_k=1), r"\[2, 65536\]"),
    (dict(mix_layers=(1,), weighting="dense"), "weighting='dense'"),
    (dict(mix_layers=[True]), "list of layer indices")])
def test_config_refusals(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        TaSQConfig(**kw)


def test_config_layers_and_json():
    cfg = TaSQConfig(mix_layers=(0, 2))
    assert cfg.key_rate(0) == (4, 256) and cfg.key_rate(1) == (8, 1024) and cfg.code_bits_k_at(0) == 8
    assert TaSQConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="lists all 2 layers"):
        TaSQConfig(mix_layers=(0, 1)).check_layers(2)
    with pytest.raises(ConfigError, match="mix_group_size_k=32 does not divide head_dim=16"):
        TaSQConfig(mix_layers=(0,), mix_group_size_k=32).check_head_dim(16)
    assert TaSQConfig().bits_k_mean(3, 64, 30) == TaSQConfig().bits_k(3, 64)


def test_calibrate_flags():
    ap = _calibrate_parser()
    cfg = build_config(ap.parse_args(["--out", "x", "--mix-layers", "17,18,21,23"]))
    assert cfg.mix_layers == (17, 18, 21, 23) and cfg.key_rate(17) == (4, 256) and cfg.key_rate(0) == (8, 1024)
    cfg = build_config(ap.parse_args(["--out", "x", "--mix-layers", "3", "--mix-group-size-k", "4",
                                      "--mix-codebook-size-k", "1024", "--rate", "1.3"]))
    assert cfg.key_rate(3) == (4, 1024)
    with pytest.raises(ConfigError, match="name the layers with --mix-layers"):
        build_config(ap.parse_args(["--out", "x", "--mix-codebook-size-k", "16"]))
    with pytest.raises(SystemExit):
        ap.parse_args(["--out", "x", "--mix-layers", "3,x"])


def test_bench_reads_a_mixed_artifact_for_the_mix_name(tmp_path):
    """``--artifact 'tasq+tasq_g4k256_g8k1024@L1=DIR'``: one mixed artifact stands for the mix
    (checked against it); an artifact with other layers, or a mixed one given for plain ``tasq``, is refused."""
    spec = M.parse("tasq+tasq@g4k256/g8k1024@L1")
    assert spec.mixed_artifact_name == "tasq+tasq_g4k256_g8k1024@L1"
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, mix_layers=(1,))
    fp = dataclasses.replace(FP, head_dim=D)
    good = save_artifact(tmp_path / "good", random_codebooks(L, H, D, config=cfg), fp, calibration={}).parent
    with pytest.raises(ValueError, match=r"codebook_size_v.*\(1024, 64\)"):  # the mix's values are g8 K1024
        M.prepare(spec, "unused", "default", tmp_path, {spec.mixed_artifact_name: str(good)})
    cfg = TaSQConfig(mix_layers=(1,))
    good = save_artifact(tmp_path / "good2", random_codebooks(L, H, D, config=cfg), fp, calibration={}).parent
    method, arts = M.prepare(spec, "unused", "default", tmp_path, {spec.mixed_artifact_name: str(good)})
    assert arts == {spec.mixed_artifact_name: good} and method.name == spec.name
    assert method.bits(H, D)[0] == pytest.approx(cfg.bits_k_mean(H, D, L))
    other = save_artifact(tmp_path / "other", random_codebooks(L, H, D, config=TaSQConfig(mix_layers=(2,))), fp,
                          calibration={}).parent
    with pytest.raises(ValueError, match=r"mix_layers.*\(\(1,\), \(2,\)\)"):
        M.prepare(spec, "unused", "default", tmp_path, {spec.mixed_artifact_name: str(other)})
    with pytest.raises(ValueError, match=r"does not fit method tasq.*mix_layers"):
        M.prepare(M.parse("tasq"), "unused", "default", tmp_path, {"tasq": str(good)})

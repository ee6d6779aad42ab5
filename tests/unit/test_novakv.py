"""NovaKV's keys (post-RoPE, query-whitened KLT, stratified groups) as a calibrated method: the
config rules, the map's algebra, calibration on *rotated* keys, the artifact and the HF path,
and the launch refusal (the serving kernels code pre-RoPE keys only)."""
from types import SimpleNamespace

import pytest
import torch

from calibrate import evaluate, pipeline, weights
from sglang_tasq import codec
from sglang_tasq.artifact import ArtifactError, ModelFingerprint, load_artifact, save_artifact
from sglang_tasq.config import ConfigError, TaSQConfig
from sglang_tasq.hf.cache import TaSQKeys
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks

FP = ModelFingerprint("LlamaForCausalLM", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      rope_theta=10000.0, rope_scaling=None)
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))


def test_config_rules_and_preset():
    nova = TaSQConfig.novakv()
    assert (nova.key_rope, nova.weighting, nova.grouping, nova.scale, nova.fisher) == \
        ("post", "qpca", "stratified", "per_head", False)
    assert (nova.group_size_k, nova.codebook_size_k) == (4, 256)
    assert nova.bits_k(3, 64) == pytest.approx(2 + 16 / 64)  # 8-bit codes per 4 dims + a fp16 scale per head
    assert TaSQConfig().key_rope == "pre"
    with pytest.raises(ConfigError, match="qpca"):
        TaSQConfig(key_rope="post", weighting="diag", grouping="stratified", fisher=False)
    with pytest.raises(ConfigError, match="qpca"):
        TaSQConfig(weighting="qpca", grouping="stratified", fisher=False)  # pre-RoPE keys
    with pytest.raises(ConfigError, match="stratified"):
        TaSQConfig(key_rope="post", weighting="qpca", grouping="covariance", fisher=False)
    with pytest.raises(ConfigError, match="Fisher"):
        TaSQConfig(key_rope="post", weighting="qpca", grouping="stratified", fisher=True)
    with pytest.raises(ConfigError, match="key_rope"):
        TaSQConfig(key_rope="mid")


def test_stratified_groups_span_the_spectrum():
    d, g = 16, 4
    perm = codec.stratified_permutation(d, g)
    assert sorted(perm.tolist()) == list(range(d))
    G = d // g
    for j in range(G):  # group j holds coefficients of ranks j, j+G, j+2G, ...
        assert perm[j * g:(j + 1) * g].tolist() == [j + i * G for i in range(g)]


def _keys_and_queries(N=4000, H=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(H, d, d, generator=gen)
    k = torch.einsum("hij,nhj->nhi", mix, torch.randn(N, H, d, generator=gen)) + 3 * torch.randn(H, d, generator=gen)
    q = torch.einsum("hij,nhj->nhi", torch.randn(H, d, d, generator=gen), torch.randn(N, H, d, generator=gen))
    return k, q


def test_qpca_map_whitens_queries_and_decorrelates_keys():
    k, q = _keys_and_queries()
    sums = torch.einsum("nhi,nhj->hij", q.double(), q.double())
    mix, unmix, mean = weights.qpca_map(k, sums, q.shape[0], floor=1e-9)
    eye = torch.eye(16).expand(2, 16, 16)
    torch.testing.assert_close(mix @ unmix, eye, atol=1e-4, rtol=0)
    torch.testing.assert_close(mean, k.mean(0), atol=1e-4, rtol=0)
    r = torch.einsum("hij,nhj->nhi", mix.double(), (k - mean).double())
    cov = torch.einsum("nhi,nhj->hij", r, r) / r.shape[0]
    diag = torch.diagonal(cov, dim1=-2, dim2=-1)
    off = cov - torch.diag_embed(diag)
    assert float(off.abs().max()) < 1e-6 * float(diag.max())  # KLT: decorrelated coefficients
    assert bool((diag[:, :-1] >= diag[:, 1:]).all())  # ranked by variance
    # squared error in the coefficients == mean squared logit error over the queries (S scaled to mean eig 1)
    S = sums / q.shape[0]
    S = S / torch.diagonal(S, dim1=-2, dim2=-1).mean(-1)[:, None, None]
    e = torch.randn(7, 2, 16, dtype=torch.float64)
    lhs = torch.einsum("hij,nhj->nhi", mix.double(), e).pow(2).sum(-1)
    rhs = torch.einsum("nhi,hij,nhj->nh", e, S, e)
    torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=0)


def _capture(W=64, n_win=4, H=2, d=16):
    """Pre-RoPE keys that are one constant vector per head: only RoPE makes them differ."""
    gen = torch.Generator().manual_seed(1)
    const = torch.randn(H, d, generator=gen) * 2 + 1
    N = W * n_win
    keys = const.expand(1, N, H, d).clone().half()
    q = torch.randn(N, 2 * H, d, generator=gen)
    qp = apply_rope(q, torch.arange(N) % W, INV_FREQ).double().view(N, H, 2, d)
    cap = SimpleNamespace(keys=keys, values=torch.randn(1, N, H, d, generator=gen).half(), fisher_k=None,
                          fisher_v=None, q_dense_sums=None, q_post_sums=torch.einsum("thri,thrj->hij", qp, qp)[None],
                          q_post_count=2 * N, q_diag_sums=torch.ones(1, H, d), q_pair_count=1, tokens=N, loss=0.0)
    ev = SimpleNamespace(keys=keys, values=cap.values, queries=q.half()[None], tokens=N)
    fp = ModelFingerprint("LlamaForCausalLM", num_layers=1, num_q_heads=2 * H, num_kv_heads=H, head_dim=d,
                          rope_theta=10000.0, rope_scaling=None)
    prep = pipeline.Prepared(fp, "none", "test", INV_FREQ, 1.0, cap, ev, W, {})
    return prep, const


def test_calibration_codes_rotated_keys():
    """The post-RoPE fit sees the keys as the model caches them (rotated at their position in the
    window): with constant pre-RoPE keys, the fitted mean is the mean of the rotated keys, and
    un-rotated keys would give the constant itself."""
    prep, const = _capture()
    cfg = TaSQConfig.novakv(codebook_size_k=16, codebook_size_v=16, group_size_v=4, max_kmeans_samples=256,
                            kmeans_iters=5, window_len=64)
    keys = pipeline.quantizer_keys(prep.train.keys[0], cfg, INV_FREQ, 1.0, 64)
    N = keys.shape[0]
    torch.testing.assert_close(keys, apply_rope(prep.train.keys[0].float(), torch.arange(N) % 64, INV_FREQ))
    res = pipeline.fit(prep, cfg, progress=False, log=lambda s: None)
    cb = res.codebooks
    rotated_mean = keys.mean(0)
    torch.testing.assert_close(cb.k_mean[0], rotated_mean, atol=1e-3, rtol=0)
    assert float((cb.k_mean[0] - const).abs().max()) > 0.5  # not the un-rotated keys' mean
    assert torch.equal(cb.k_perm[0, 0], codec.stratified_permutation(16, 4))
    # the fit reconstructs the rotated keys: held-out error small (16 codewords of 4 dims, 64 positions)
    assert res.errors["key_mse"] < 0.2
    # evaluate turns the reconstruction back before RoPE: the same figure as computed post-RoPE
    codes, scale = codec.encode_keys(keys, cb, 0)
    k_hat = codec.decode_keys(codes, scale, cb, 0)
    post_mse = float(((keys - k_hat) ** 2).sum() / (keys ** 2).sum())
    got = evaluate.layer_errors(cb, 0, prep.heldout.keys[0], prep.heldout.values[0], None, 64)["key_mse"]
    assert got == pytest.approx(post_mse, rel=1e-4)


def test_pre_rope_configs_keep_captured_keys():
    keys = torch.randn(128, 2, 16).half()
    assert torch.equal(pipeline.quantizer_keys(keys, TaSQConfig(), INV_FREQ, 1.0, 64), keys.float())


def test_artifact_round_trip_and_checks(tmp_path):
    cfg = TaSQConfig.novakv(codebook_size_k=64, codebook_size_v=64)
    cb = random_codebooks(2, 2, 16, cfg)
    path = save_artifact(tmp_path / "nova", cb, FP, {"corpus": "test", "tokens": 0, "seed": 0, "wall_time_s": 0.0})
    got = load_artifact(path, model=FP).codebooks
    assert got.config.key_rope == "post" and not got.pairs_in_groups
    for name in ("k_mean", "k_mix", "k_unmix", "k_codebook"):
        torch.testing.assert_close(getattr(got, name), getattr(cb, name))
    # encode/decode of post-RoPE keys through the HF side: the cache must not un-rotate them
    keys = TaSQKeys(got)
    assert keys.pre_rope is False
    x = torch.randn(9, 2, 16)
    p = keys.encode(x, 1, {})
    ref = codec.decode_keys(*codec.encode_keys(x, got, 1), got, 1)
    torch.testing.assert_close(keys.decode(p, 1, {}), ref)
    from safetensors.torch import load_file, save_file

    tpath = path.parent / "tasq.safetensors"
    t = load_file(str(tpath))
    t["k.perm"] = torch.arange(16, dtype=torch.int32).expand(2, 2, 16).contiguous()
    save_file(t, str(tpath))
    import hashlib
    import json

    m = json.loads(path.read_text())
    m["tensors"].update(bytes=tpath.stat().st_size, sha256=hashlib.sha256(tpath.read_bytes()).hexdigest())
    path.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="stratified"):
        load_artifact(path)


def test_artifact_without_mean_is_refused(tmp_path):
    cfg = TaSQConfig.novakv(codebook_size_k=64, codebook_size_v=64)
    cb = random_codebooks(2, 2, 16, cfg)
    cb.k_mean = None
    path = save_artifact(tmp_path / "nova", cb, FP, {"corpus": "test", "tokens": 0, "seed": 0, "wall_time_s": 0.0})
    with pytest.raises(ArtifactError, match="k.mean"):
        load_artifact(path)


def test_rotated_scalar_values_bits_and_error():
    from sglang_tasq.hf.novakv import RotatedScalarValues

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 64, generator=gen) * torch.linspace(0.1, 3, 64) + 0.5
    errs = []
    for bits in (1, 2, 4, 8):
        q = RotatedScalarValues(bits)
        p = q.encode(x, 0, {})
        stored = sum(t.nbytes for t in p.values()) * 8
        assert stored == pytest.approx(q.bits_per_element(3, 64) * x.numel())
        xh = q.decode(p, 0, {})
        errs.append(float(((x - xh) ** 2).sum() / (x ** 2).sum()))
    assert errs == sorted(errs, reverse=True) and errs[-1] < 5e-3  # at 8 bits only the 0.92 clip is left
    assert errs[0] > 1  # 1-bit min/max codes land on the clipped extremes: why novakv1 keeps VQ values
    assert RotatedScalarValues(2).bits_per_element(3, 64) == 2.5  # fp16 step + minimum per 64 channels


def test_bench_methods_name_their_artifacts():
    from bench import methods as M

    nova, nova1 = M.parse("novakv"), M.parse("novakv1")
    assert (nova.artifact_name, nova1.artifact_name) == ("novakv_g4k256", "novakv_g8k1024")
    argv = nova.calibrate_argv("smollm2-135m", "default", "out")
    assert argv[argv.index("--method") + 1] == "novakv" and argv[argv.index("--group-size") + 1] == "4"
    assert nova.expected_config()["key_rope"] == "post" and M.parse("tasq").expected_config()["key_rope"] == "pre"
    assert M.parse("nsnquant").closed_form == "nsnquant" and M.parse("nsnquant2").artifact_name is None
    with pytest.raises(ValueError, match="RoPE"):
        M.build(M.parse("nsnquant"))
    cfg = TaSQConfig.novakv(codebook_size_k=64, codebook_size_v=64)
    from sglang_tasq.hf.novakv import novakv

    m = novakv(random_codebooks(2, 2, 16, cfg), 2, "novakv")
    assert m.keys.pre_rope is False and m.bits(2, 16) == pytest.approx((6 / 4 + 1, 2 + 2))
    m1 = novakv(random_codebooks(2, 2, 16, cfg), None, "novakv1")  # the artifact's VQ values
    assert m1.bits(2, 16)[1] == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="before RoPE"):
        novakv(random_codebooks(2, 2, 16))


def test_hf_cache_codes_the_post_rope_keys_it_is_given():
    """Inside a real (tiny, random-weight) Llama, the cache hands NovaKV's keys over as the model
    rotated them and reads back exactly codec's decode of those post-RoPE keys (no un-rotation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_tasq.hf.cache import QuantizedKVCache
    from sglang_tasq.hf.novakv import novakv

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    cb = random_codebooks(2, 2, 16, TaSQConfig.novakv(codebook_size_k=64, codebook_size_v=64),
                          rope_theta=cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    exact = QuantizedKVCache(novakv(cb, None), sink=0, recent=10**6)  # everything exact: the model's own keys
    coded = QuantizedKVCache(novakv(cb, None), sink=0, recent=0, fresh_exact=False)
    with torch.no_grad():
        model(ids, past_key_values=exact)
        out = model(ids, past_key_values=coded).logits
    assert torch.isfinite(out).all()
    k_post = exact.layers[0].keys[0].transpose(0, 1).float()  # [T, H, d] as HF cached them
    want = codec.decode_keys(*codec.encode_keys(k_post, cb, 0), cb, 0)
    got = coded.layers[0].keys[0].transpose(0, 1).float()
    torch.testing.assert_close(got, want.to(got.dtype).float(), atol=0.05, rtol=0.02)

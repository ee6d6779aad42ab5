"""CPU fast paths of the TaSQ pool and backend give the reference codec's results: the same
codes (bitwise), the same decoded keys/values and RoPE (bitwise), attention within fp tolerance.
The SmolLM2-shaped checks run on random codebooks and (``slow``: the ``artifact`` fixture may
calibrate) on the calibrated artifact's."""
import pytest
import torch

from sglang_tasq import codec, packing
from sglang_tasq.srt.backend import _sdpa
from sglang_tasq.config import TaSQConfig
from sglang_tasq.rope import apply_rope
from sglang_tasq.testing import random_codebooks

SMOLLM2_CODEBOOKS = ["random", pytest.param("calibrated", marks=pytest.mark.slow)]


@pytest.fixture(params=SMOLLM2_CODEBOOKS)
def smollm2_codebooks(request):
    """SmolLM2-shaped codebooks (3 KV heads of 64, K = 1024): random, or the calibrated artifact's."""
    if request.param == "calibrated":
        from sglang_tasq.artifact import load_artifact

        return load_artifact(str(request.getfixturevalue("artifact"))).codebooks
    cfg = TaSQConfig(codebook_size_k=1024, codebook_size_v=1024)
    return random_codebooks(num_layers=2, num_kv_heads=3, head_dim=64, config=cfg)


def _pool(cb):
    from _pools import make_pool

    return make_pool(cb, size=8, window_rows=1)


@pytest.mark.parametrize("T", [1, 3, 17, 300])
@pytest.mark.parametrize("scale", ["shared", "per_head", "none"])
def test_prepared_nearest_gives_reference_codes(T, scale):
    cb = random_codebooks(num_layers=2, num_kv_heads=3, head_dim=32,
                          config=TaSQConfig(codebook_size_k=256, codebook_size_v=128, scale=scale), seed=T)
    torch.manual_seed(T)
    k, v = torch.randn(T, 3, 32) * 2, torch.randn(T, 3, 32)
    x, _ = codec.key_tailor(k, cb, 1)
    near_k = codec.LayerNearest(cb.tailored_k_codebook)
    assert torch.equal(near_k(x, 1), codec.encode_keys(k, cb, 1)[0])
    assert torch.equal(codec.nearest_codeword(x, cb.tailored_k_codebook(1),
                                              prepared=codec.prepare_codebook(cb.tailored_k_codebook(1))),
                       codec.nearest_codeword(x, cb.tailored_k_codebook(1)))
    near_v = codec.LayerNearest(lambda layer: cb.v_codebook[layer])
    assert torch.equal(near_v(v.view(T, 3, 4, 8), 0), codec.encode_values(v, cb, 0))
    # ties: a token equal to a codeword duplicated earlier in the book picks the first copy
    book = cb.v_codebook[0].clone()
    book[:, :, 5] = book[:, :, 2]
    xt = book[:, :, 2].unsqueeze(0).expand(2, -1, -1, -1).clone()
    got = codec.LayerNearest(lambda layer: book)(xt, 0)
    assert torch.equal(got, codec.nearest_codeword(xt, book)) and bool((got == 2).all())


def test_prepared_nearest_real_shapes(smollm2_codebooks):
    cb = smollm2_codebooks
    torch.manual_seed(0)
    k, v = torch.randn(700, 3, 64) * 3, torch.randn(700, 3, 64)
    x, _ = codec.key_tailor(k, cb, 0)
    assert torch.equal(codec.LayerNearest(cb.tailored_k_codebook)(x, 0), codec.encode_keys(k, cb, 0)[0])
    assert torch.equal(codec.LayerNearest(lambda layer: cb.v_codebook[layer])(v.view(700, 3, 8, 8), 0),
                       codec.encode_values(v, cb, 0))


@pytest.mark.parametrize("n,bits", [(1, 10), (24, 10), (3, 8), (7, 12), (5, 1), (9, 16), (4, 17), (6, 3)])
def test_fast_unpack_matches_reference(n, bits):
    torch.manual_seed(n * bits)
    codes = torch.randint(0, 1 << bits, (13, n))
    codes[0] = (1 << bits) - 1
    packed = packing.pack_codes(codes, bits)
    fast = packing.Unpacker()
    assert torch.equal(fast(packed, n, bits), packing.unpack_codes(packed, n, bits))
    assert torch.equal(fast(packed[:0], n, bits), packing.unpack_codes(packed[:0], n, bits))


@pytest.mark.parametrize("scale", ["shared", "per_head", "none"])
def test_fast_decode_matches_reference(scale):
    cb = random_codebooks(num_layers=2, num_kv_heads=3, head_dim=32,
                          config=TaSQConfig(codebook_size_k=64, codebook_size_v=32, scale=scale))
    torch.manual_seed(1)
    k, v = torch.randn(50, 3, 32), torch.randn(50, 3, 32)
    kc, ks = codec.encode_keys(k, cb, 1)
    vc = codec.encode_values(v, cb, 1)
    kd, vd = _pool(cb)._decode(kc, ks, vc, 1)
    assert torch.equal(kd, codec.decode_keys(kc, ks, cb, 1))
    assert torch.equal(vd, codec.decode_values(vc, cb, 1))
    kd, vd = _pool(cb)._decode(kc[:0], None if ks is None else ks[:0], vc[:0], 1)  # empty prefix
    assert torch.equal(kd, codec.decode_keys(kc[:0], None if ks is None else ks[:0], cb, 1))
    assert torch.equal(vd, codec.decode_values(vc[:0], cb, 1))


def test_cached_rope_table_matches_apply_rope(smollm2_codebooks):
    cb = smollm2_codebooks
    from _pools import make_backend

    be = make_backend(_pool(cb))
    from sglang_tasq.rope import rotate

    torch.manual_seed(2)
    for n in (5, 1500, 3000):
        x = torch.randn(n, 3, 64)
        cos, sin = be._cos_sin(n, x.device)
        assert torch.equal(rotate(x, cos, sin), apply_rope(x, torch.arange(n), cb.inv_freq, cb.attention_scaling))


@pytest.mark.parametrize("Tq,S", [(1, 1), (1, 37), (37, 37), (5, 40), (64, 300)])
def test_sdpa_matches_attention_dense(Tq, S):
    torch.manual_seed(Tq + S)
    q, k, v = torch.randn(Tq, 9, 64), torch.randn(S, 3, 64), torch.randn(S, 3, 64)
    pos = torch.arange(S)
    ref = codec.attention_dense(q, pos[S - Tq:], k, v, pos, 0.125, causal=True)
    torch.testing.assert_close(_sdpa(q, k, v, 0.125), ref, rtol=1e-4, atol=1e-5)


def test_blocked_argmin_first_on_ties_and_nonfinite_inputs():
    torch.manual_seed(3)
    d = torch.randint(0, 5, (4, 7, 256)).float()  # many ties
    assert torch.equal(codec._first_argmin(d), torch.argmin(d, dim=-1))
    d = torch.randn(2, 3, 1024)
    d[0, 0, 700] = d[0, 0, 100] = -10.0
    assert torch.equal(codec._first_argmin(d), torch.argmin(d, dim=-1))
    cb = random_codebooks(num_layers=1, num_kv_heads=2, head_dim=16,
                          config=TaSQConfig(codebook_size_k=256, codebook_size_v=256))
    x = torch.randn(6, 2, 2, 8)
    x[1, 0, 0, 3], x[2, 1, 1, 0], x[3, 0, 1, 1] = float("nan"), float("inf"), 1e38
    book = cb.v_codebook[0]
    assert torch.equal(codec.LayerNearest(lambda layer: book)(x, 0), codec.nearest_codeword(x, book))


CHUNKS = [(1, 1, 0, 0, 256), (5, 40, 2, 3, 2), (37, 37, 4, 8, 16), (64, 300, 3, 0, 256), (20, 50, 0, 7, 7),
          (30, 50, 0, 0, 8), (300, 1000, 64, 256, 256), (700, 700, 64, 256, 256), (9, 777, 64, 256, 128)]


def _mixed_case(Tq, S, seed):
    torch.manual_seed(seed)
    q = torch.randn(Tq, 6, 16)
    k_ex, v_ex = torch.randn(S, 2, 16), torch.randn(S, 2, 16)
    k_dec, v_dec = k_ex + 0.3 * torch.randn(S, 2, 16), v_ex + 0.3 * torch.randn(S, 2, 16)
    return q, k_ex, v_ex, k_dec, v_dec


def _per_query_reference(q, k_ex, v_ex, k_dec, v_dec, sink, recent):
    """Plain attention per query over its own mix of exact and decoded keys (codec.attention_dense)."""
    from sglang_tasq.windows import query_window

    Tq, S = q.shape[0], k_ex.shape[0]
    q_pos, k_pos = torch.arange(S - Tq, S), torch.arange(S)
    ex = query_window(q_pos, k_pos, sink, recent)
    out = []
    for i in range(Tq):
        m = ex[i][:, None, None]
        out.append(codec.attention_dense(q[i:i + 1], q_pos[i:i + 1], torch.where(m, k_ex, k_dec),
                                         torch.where(m, v_ex, v_dec), k_pos, 0.25, causal=True))
    return torch.cat(out)


@pytest.mark.parametrize("Tq,S,sink,recent,block", CHUNKS)
def test_windowed_attention_matches_per_query_reference(Tq, S, sink, recent, block):
    """The CUDA extend path's mixed attention (query i reads key j from the exact k/v iff
    j < sink or j >= i + 1 - recent, from the decoded ones otherwise), computed in query
    blocks, equals plain attention per query over its own mix of keys; with every key exact
    it is the all-exact SDPA path."""
    from sglang_tasq.srt.backend import _windowed_attention
    from sglang_tasq.windows import query_window

    q, k_ex, v_ex, k_dec, v_dec = _mixed_case(Tq, S, Tq * S + sink + recent)
    q_pos, k_pos = torch.arange(S - Tq, S), torch.arange(S)
    ex = query_window(q_pos, k_pos, sink, recent)
    causal = k_pos[None, :] <= q_pos[:, None]
    got = _windowed_attention(q, k_ex, v_ex, k_dec, v_dec, ex & causal, causal, 0.25, block=block)
    torch.testing.assert_close(got, _per_query_reference(q, k_ex, v_ex, k_dec, v_dec, sink, recent),
                               rtol=1e-5, atol=1e-5)
    full = torch.ones_like(causal)
    torch.testing.assert_close(_windowed_attention(q, k_ex, v_ex, k_dec, v_dec, full & causal, causal, 0.25, block),
                               _sdpa(q, k_ex, v_ex, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Tq,S,sink,recent,block", CHUNKS)
def test_windowed_prefill_matches_per_query_reference(Tq, S, sink, recent, block):
    """The CPU extend path (two disjoint key sets per aligned query block, merged by their
    log-sum-exp) equals plain attention per query over its own mix of keys: to fp32 rounding in
    fp32, to bf16 rounding in bf16 (the model dtype it runs in inside the server)."""
    from sglang_tasq.srt.backend import windowed_prefill

    q, k_ex, v_ex, k_dec, v_dec = _mixed_case(Tq, S, Tq * S + sink + recent)
    ref = _per_query_reference(q, k_ex, v_ex, k_dec, v_dec, sink, recent)
    got = windowed_prefill(q, k_ex, v_ex, k_dec, v_dec, sink, recent, 0.25, block=block)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    got16 = windowed_prefill(q.bfloat16(), k_ex, v_ex, k_dec, v_dec, sink, recent, 0.25, block=block)
    assert got16.dtype == torch.float32
    assert float((got16 - ref).norm() / ref.norm()) < 8e-3  # bf16 inputs and block outputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_windowed_prefill_rows_do_not_depend_on_the_chunking(dtype):
    """A query's attention row is bit-identical whether its prompt is prefilled in one chunk, in
    chunks cut anywhere, or after a cached prefix of any length (whole aligned blocks: the kernel
    sees the same shapes for every row)."""
    from sglang_tasq.srt.backend import windowed_prefill

    S = 1100
    q, k_ex, v_ex, k_dec, v_dec = _mixed_case(S, S, 7)
    q = q.to(dtype)
    whole = windowed_prefill(q, k_ex, v_ex, k_dec, v_dec, 64, 256, 0.25)
    for cuts in ([256], [700], [1, 300, 1099], [255, 513, 769]):
        bounds = [0] + cuts + [S]
        parts = [windowed_prefill(q[a:b], k_ex[:b], v_ex[:b], k_dec[:b], v_dec[:b], 64, 256, 0.25)
                 for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts


class _Extend:
    def is_decode(self):
        return False


def _extend(backend, row: int, P: int, S: int, q, k, v, layer):
    """One extend of positions P..S-1 of request ``row`` (slots 1..S) through the real backend:
    store the chunk's k/v, then attend -> [S - P, Hq * d]."""
    import types

    Tq = S - P
    fb = types.SimpleNamespace(seq_lens=torch.tensor([S]), extend_seq_lens=torch.tensor([Tq]),
                               req_pool_indices=torch.tensor([row]), positions=torch.arange(P, S),
                               out_cache_loc=torch.arange(P + 1, S + 1), forward_mode=_Extend())
    backend.init_forward_metadata(fb)
    return backend._forward(q[P:S], k[P:S], v[P:S], layer, fb, True)


@pytest.mark.parametrize("kernels", [True, False])
def test_extend_rows_are_the_same_cold_chunked_and_warm(kernels):
    """The backend's extend through a real pool (codes and exact store written by the forward
    itself): a prompt prefilled in one chunk, in chunks of 256 and of odd sizes, or as its last
    tokens over a prefix an earlier forward wrote (a radix hit), gives bit-identical attention
    rows: window keys are attended with the store's rounding whoever wrote them, and every
    block is computed whole."""
    import types

    from _pools import make_backend, make_pool

    cfg = TaSQConfig(codebook_size_k=256, codebook_size_v=256, sink_window=8, recent_window=40)
    cb = random_codebooks(num_layers=1, num_kv_heads=3, head_dim=32, config=cfg, seed=5)
    S = 600
    layer = types.SimpleNamespace(tp_q_head_num=9, tp_k_head_num=3, qk_head_dim=32, v_head_dim=32, layer_id=0,
                                  scaling=32 ** -0.5)
    torch.manual_seed(0)
    q = torch.randn(S, 9 * 32).bfloat16()
    k, v = (2 * torch.randn(S, 3 * 32)).bfloat16(), torch.randn(S, 3 * 32).bfloat16()

    def served(cuts):
        pool = make_pool(cb, size=S + 8, window_rows=2, cpu_kernels=kernels)
        backend = make_backend(pool, req_rows=2, max_context_len=S + 8)
        backend.req_to_token_pool.req_to_token[1, :S] = torch.arange(1, S + 1)
        pool._live[1] = (0, 0)
        bounds = [0] + cuts + [S]
        return torch.cat([_extend(backend, 1, a, b, q, k, v, layer) for a, b in zip(bounds, bounds[1:])])

    cold = served([])
    assert torch.isfinite(cold).all()
    for cuts in ([256, 512], [1, 77, 300], [S - 1], [S - 5]):
        assert torch.equal(served(cuts), cold), cuts


def test_forward_profile_records_each_extend_and_changes_nothing(tmp_path, monkeypatch):
    """SGLANG_TASQ_PROFILE (what bench.prefill reads): one JSON line per forward, written after
    the last layer, with the encode / codes / attention parts inside the forward's time; the
    served rows are the same with and without it."""
    import types

    from _pools import make_backend, make_pool
    from sglang_tasq.srt import profile

    cfg = TaSQConfig(codebook_size_k=256, codebook_size_v=256, sink_window=8, recent_window=40)
    cb = random_codebooks(num_layers=2, num_kv_heads=3, head_dim=32, config=cfg, seed=5)
    S = 300
    layers = [types.SimpleNamespace(tp_q_head_num=9, tp_k_head_num=3, qk_head_dim=32, v_head_dim=32, layer_id=i,
                                    scaling=32 ** -0.5) for i in range(2)]
    torch.manual_seed(0)
    q = torch.randn(S, 9 * 32).bfloat16()
    k, v = (2 * torch.randn(S, 3 * 32)).bfloat16(), torch.randn(S, 3 * 32).bfloat16()

    def served(path):
        if path is None:
            monkeypatch.delenv(profile.ENV, raising=False)
        else:
            monkeypatch.setenv(profile.ENV, str(path))
        pool = make_pool(cb, size=S + 8, window_rows=2)
        backend = make_backend(pool, req_rows=2, max_context_len=S + 8)
        backend.req_to_token_pool.req_to_token[1, :S] = torch.arange(1, S + 1)
        pool._live[1] = (0, 0)
        out = []
        for a, b in ((0, 200), (200, S)):  # two forwards (chunks), two layers each
            fb = types.SimpleNamespace(seq_lens=torch.tensor([b]), extend_seq_lens=torch.tensor([b - a]),
                                       req_pool_indices=torch.tensor([1]), positions=torch.arange(a, b),
                                       out_cache_loc=torch.arange(a + 1, b + 1), forward_mode=_Extend())
            backend.init_forward_metadata(fb)
            out += [backend._forward(q[a:b], k[a:b], v[a:b], lay, fb, True) for lay in layers]
        return torch.cat(out)

    path = tmp_path / "prof.jsonl"
    assert torch.equal(served(path), served(None))
    recs = profile.read(path)
    assert [(r["mode"], r["tokens"]) for r in recs] == [("extend", 200), ("extend", 100)]
    for r in recs:
        assert set(r["parts_s"]) == {"store", "codes", "attention"}
        assert all(t > 0 for t in r["parts_s"].values())
        assert sum(r["parts_s"].values()) <= r["forward_s"]
    assert profile.read(tmp_path / "missing.jsonl") == []

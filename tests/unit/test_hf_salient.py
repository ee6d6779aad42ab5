"""Salient tokens in the HF TaSQCache (issue 14): the cache reads each layer's queries through
hooks, scores their window echo and keeps the same tokens, read the same way, as the decode view
(bench.attention_error, the harness behind the NIAH figures) and the server."""
import dataclasses
import gc

import pytest
import torch
from _support import tiny_decode_view_llama

from bench import attention_error as ae
from sglang_tasq import salient as sal
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import TaSQCache
from sglang_tasq.testing import random_codebooks

V = 128
SPEC = dict(salient_budget=3, salient_block=16, salient_layer=1, salient_after=4)
SINK = 4


@pytest.fixture(scope="module")
def model():
    return tiny_decode_view_llama(V)


def _tiny_qwen3():
    """A random-weight Qwen3 (per-head q_norm / k_norm) on the decode-view attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, max_position_embeddings=1024)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a tap skipping q_norm would read other queries
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
    ae.use_decode_view(m)
    return m


@pytest.fixture(scope="module")
def plain():
    return random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=5)


@pytest.fixture(scope="module")
def salient(plain):
    return dataclasses.replace(plain, config=dataclasses.replace(plain.config, **SPEC))


def _recent(cb):
    return cb.config.salient_block + cb.config.salient_spec().lookahead


def _ids(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def _token_by_token(model, cache, ids, steps):
    """Logits after every prompt token (fed one at a time: every query reads the per-query window
    rule, as the server does) and after ``steps`` greedy tokens."""
    out = []
    with torch.no_grad():
        for t in ids:
            out.append(model(t.view(1, 1), past_key_values=cache).logits[0, -1])
        for _ in range(steps):
            out.append(model(out[-1].argmax().view(1, 1), past_key_values=cache).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("arch,fmt", [("llama", "bf16"), ("qwen3", "bf16"), ("llama", "fp8"), ("llama", "res4")])
def test_fed_token_by_token_it_reads_what_the_decode_view_reads(model, plain, salient, arch, fmt):
    """Same kept set and same logits as the decode view's streaming rule on one forward of the
    prompt; the kept tokens change the logits (against the windows alone) past the first horizon.
    Qwen3: the tap applies the attention module's q_norm, as HF does. fp8: an artifact whose
    server holds fp8 exact copies (``exact_format``) has them held so in the cache, as the decode
    view's ``:x8`` points hold them; res4 likewise (the codes the cache just made, plus a 4-bit
    residual, as ``:r4`` points)."""
    model = model if arch == "llama" else _tiny_qwen3()
    ids, steps = _ids(160, 10), 3
    if fmt != "bf16":
        salient = dataclasses.replace(salient, config=dataclasses.replace(salient.config, exact_format=fmt))
    spec, recent = salient.config.salient_spec(), _recent(salient)
    cache = TaSQCache(salient, SINK, recent, model=model)
    assert cache.exact_format == (None if fmt == "bf16" else fmt)
    got = _token_by_token(model, cache, ids, steps)

    probe = ae.Probe(ae.ProbeCache(TaSQCache(plain).method, side=fmt), SINK, recent, salient=spec,
                     select_at=len(ids))
    with torch.no_grad(), ae.active(probe):
        logits = model(ids[None], past_key_values=probe.cache).logits[0]
        want = [logits]
        for _ in range(steps):
            logits = model(logits[-1].argmax().view(1, 1), past_key_values=probe.cache).logits[0]
            want.append(logits)
    want = torch.cat(want)
    assert cache.kept_positions().numel() == 3 * sal.decided_blocks(len(ids) + steps, spec) > 0
    if fmt == "res4":
        # res4 copies hang on the codes' reading: here position 0's key scale in layer 1 is one
        # fp16 ulp apart between a one-token forward and the whole prompt's, which moves that sink
        # copy by a residual step and one near-tied kept token of one block; everything before
        # that block's decision is the decode view's
        kc, kv = cache.kept_positions(), probe.kept["all"]
        differ = kc[~torch.isin(kc, kv)]
        blk = int(differ.min()) // spec.block if differ.numel() else len(ids)
        assert differ.numel() <= 1 and torch.equal(kc[kc < blk * spec.block], kv[kv < blk * spec.block]), (kc, kv)
        upto = sal.block_horizon(blk, spec) if differ.numel() else len(want)
        assert upto > len(ids) // 2 and torch.allclose(got[:upto], want[:upto], atol=1e-3)
        return
    assert torch.equal(cache.kept_positions(), probe.kept["all"])
    # fp8: a key one float rounding away from a code boundary (the view un-rotates a whole
    # prompt, the cache one token) lands on the next code: rare, ~1e-4 in the logits
    assert torch.allclose(got, want, atol=1e-4 if fmt == "bf16" else 1e-3)
    assert float((got - want).abs().amax(-1).median()) < 1e-5

    windows_only = _token_by_token(model, TaSQCache(salient, SINK, recent, model=model, salient=False), ids, steps)
    horizon = sal.block_horizon(0, spec)
    assert torch.allclose(windows_only[:horizon], got[:horizon], atol=1e-6)
    assert not torch.allclose(windows_only[horizon + recent:], got[horizon + recent:], atol=1e-4)
    if fmt != "bf16":  # the held copies matter: model-dtype copies give other logits
        bf = _token_by_token(model, TaSQCache(salient, SINK, recent, model=model, exact_format=None), ids, steps)
        assert not torch.allclose(bf, got, atol=1e-4)


def test_rows_of_a_batch_keep_their_own_tokens(model, salient):
    """A batch of two prompts keeps, per row, what each prompt keeps alone (generate())."""
    recent = _recent(salient)
    a, b = _ids(150, 1), _ids(150, 2)

    def run(ids):
        cache = TaSQCache(salient, SINK, recent, model=model)
        with torch.no_grad():
            model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        return cache

    both = run(torch.stack([a, b]))
    for row, ids in enumerate((a, b)):
        alone = run(ids[None]).kept_positions()
        assert alone.numel() > 0 and torch.equal(both.kept_positions(row), alone)
    assert not torch.equal(both.kept_positions(0), both.kept_positions(1))


def test_stored_bytes_count_the_kept_copies_positions_and_echo(model, salient):
    recent = _recent(salient)
    ids = _ids(200, 3)
    cache = TaSQCache(salient, SINK, recent, model=model)
    _token_by_token(model, cache, ids, 0)
    T, H, d, L = 200, 2, 16, 2
    kept = cache.kept_positions()
    outside = int(((kept >= SINK) & (kept < T - recent)).sum())
    br = cache.memory_breakdown()
    layers_reading = L - salient.config.salient_layer  # layers from the deciding one on
    assert outside > 0 and br["salient"] == outside * H * d * 4 * 2 * layers_reading  # fp32 model, k and v
    assert br["salient_pos"] == kept.numel() * 4
    assert br["echo"] == (salient.config.salient_layer + 1) * H * T * 2
    plain_bytes = TaSQCache(salient, SINK, recent, model=model, salient=False)
    _token_by_token(model, plain_bytes, ids, 0)
    assert cache.memory_bytes() - plain_bytes.memory_bytes() == br["salient"] + br["salient_pos"] + br["echo"]


def test_refusals_and_hooks(model, plain, salient):
    with pytest.raises(ValueError, match="model="):
        TaSQCache(salient, SINK, _recent(salient))
    with pytest.raises(ValueError, match="keeps no salient"):
        TaSQCache(plain, SINK, 64, model=model, salient=True)
    with pytest.raises(ValueError, match="recent window"):
        TaSQCache(salient, SINK, _recent(salient) - 1, model=model)

    attn = model.model.layers[0].self_attn

    def hooks():
        return len(attn._forward_pre_hooks) + len(attn.q_proj._forward_hooks)

    gc.collect()  # caches of earlier tests take their hooks off when collected
    base = hooks()
    cache = TaSQCache(salient, SINK, _recent(salient), model=model)
    assert hooks() == base + 2
    cache.close()
    assert hooks() == base
    cache = TaSQCache(salient, SINK, _recent(salient), model=model)
    del cache
    gc.collect()
    assert hooks() == base

    other = tiny_decode_view_llama(V)  # a cache tapping one model, used with another, says so
    cache = TaSQCache(salient, SINK, _recent(salient), model=other)
    with torch.no_grad(), pytest.raises(RuntimeError, match="no queries of layer 0"):
        model(_ids(8, 0)[None], past_key_values=cache)

"""Stage 1: capture what calibration needs from the model over 2048-token windows.

Per layer and token: pre-RoPE keys (k_proj output, after k_norm when the model has one),
values (v_proj output), and the diagonal empirical Fisher ``(dL/dk)^2``, ``(dL/dv)^2`` of
the next-token LM loss w.r.t. those outputs (one forward + backward per window; weights are
frozen, only activation gradients are computed). Queries are not stored: their
contribution to the query-guided weights is reduced per window in closed form
(:mod:`calibrate.weights`), and sampled causal-pair moments are kept for the dense ablation.

Stored in fp16 / bf16 (Fisher): [L, N, H, d] each, ~1.5 GB per tensor at 128k tokens on
SmolLM2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from sglang_tasq.rope import apply_rope

from . import weights as qw


@dataclass
class Captured:
    keys: torch.Tensor  # [L, N, H, d] fp16 pre-RoPE
    values: torch.Tensor  # [L, N, H, d] fp16
    fisher_k: Optional[torch.Tensor]  # [L, N_fisher, H, d] bf16 (first windows) or None
    fisher_v: Optional[torch.Tensor]
    q_diag_sums: torch.Tensor  # [L, H, d] float64
    q_pair_count: int
    q_dense_sums: Optional[torch.Tensor]  # [L, H, d, d] float64 (dense ablation)
    q_dense_count: int
    tokens: int
    loss: float  # mean LM loss of the bf16 model over the Fisher windows (else the first window)
    queries: Optional[torch.Tensor] = None  # [L, N, Hq, d] fp16 pre-RoPE, if stored
    q_post_sums: Optional[torch.Tensor] = None  # [L, H, d, d] float64: sum of post-RoPE q q^T (NovaKV)
    q_post_count: int = 0  # query vectors in q_post_sums per KV head


def _store_sq(buf, li, r, W, H, d):
    def hook(grad):
        buf[li, r:r + W] = grad.detach().reshape(W, H, d).float().pow(2)
    return hook


def _attn_modules(model):
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


def capture(model, windows: torch.Tensor, inv_freq: torch.Tensor, fisher_windows: int = 0,
            dense_pairs: int = 0, seed: int = 0, progress: bool = True,
            store_queries: bool = False, post_rope_queries: bool = False) -> Captured:
    """Run ``model`` over ``windows`` [n, W] token ids and collect the calibration statistics
    (on the model's device; what is stored lives on the CPU).

    The first ``fisher_windows`` windows also get a backward pass for the Fisher (their
    tokens are rows ``[0, fisher_windows * W)`` of ``fisher_k``/``fisher_v``). With
    ``store_queries`` the pre-RoPE queries [L, N, Hq, d] fp16 are kept (for evaluation); with
    ``post_rope_queries`` the second moment of the post-RoPE queries (positions 0..W-1 of each
    window, summed over the query heads of each KV head) is accumulated (NovaKV's key map).
    """
    cfg = model.config
    device = next(model.parameters()).device
    attn = _attn_modules(model)
    L = len(attn)
    Hq = cfg.num_attention_heads
    H = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    n, W = windows.shape
    N = n * W
    keys = torch.empty(L, N, H, d, dtype=torch.float16)
    values = torch.empty(L, N, H, d, dtype=torch.float16)
    n_fisher = min(fisher_windows, n)
    fisher = n_fisher > 0
    fk = torch.empty(L, n_fisher * W, H, d, dtype=torch.bfloat16) if fisher else None
    fv = torch.empty(L, n_fisher * W, H, d, dtype=torch.bfloat16) if fisher else None
    queries = torch.empty(L, N, Hq, d, dtype=torch.float16) if store_queries else None
    qsum = torch.zeros(L, H, d, dtype=torch.float64)
    qdense = torch.zeros(L, H, d, d, dtype=torch.float64) if dense_pairs else None
    qpost = torch.zeros(L, H, d, d, dtype=torch.float64) if post_rope_queries else None
    positions = torch.arange(W, device=device)
    gen = torch.Generator().manual_seed(seed)
    state = {"row": 0}
    count = {"diag": 0, "dense": 0}

    def key_src(a):
        return a.k_norm if hasattr(a, "k_norm") else a.k_proj

    def q_src(a):
        return a.q_norm if hasattr(a, "q_norm") else a.q_proj

    hooks = []
    for li, a in enumerate(attn):
        def on_k(mod, inp, out, li=li):
            k = out.detach().reshape(W, H, d)
            r = state["row"]
            keys[li, r:r + W] = k.half()
            if fisher and out.requires_grad:
                out.register_hook(_store_sq(fk, li, r, W, H, d))

        def on_v(mod, inp, out, li=li):
            r = state["row"]
            values[li, r:r + W] = out.detach().reshape(W, H, d).half()
            if fisher and out.requires_grad:
                out.register_hook(_store_sq(fv, li, r, W, H, d))

        def on_q(mod, inp, out, li=li):
            q = out.detach().reshape(W, Hq, d).float()
            if queries is not None:
                queries[li, state["row"]:state["row"] + W] = q.half()
            s, c = qw.causal_diag_sums(q, inv_freq, H)
            qsum[li] += s.cpu()
            if qpost is not None:
                qp = apply_rope(q, positions, inv_freq.to(q.device)).double().view(W, H, Hq // H, d)
                qpost[li] += torch.einsum("thri,thrj->hij", qp, qp).cpu()
            q = q.cpu()
            if li == 0:
                count["diag"] += c
            if qdense is not None:
                m, c2 = qw.dense_moments(q, inv_freq, H, dense_pairs, gen)
                qdense[li] += m
                if li == 0:
                    count["dense"] += c2

        hooks.append(key_src(a).register_forward_hook(on_k))
        hooks.append(a.v_proj.register_forward_hook(on_v))
        hooks.append(q_src(a).register_forward_hook(on_q))
    emb = model.get_input_embeddings()
    if fisher:
        hooks.append(emb.register_forward_hook(lambda m, i, o: o.requires_grad_()))
    for p in model.parameters():
        p.requires_grad_(False)
    losses = []
    try:
        for i in tqdm(range(n), desc="capture", unit="win", disable=not progress):
            state["row"] = i * W
            ids = windows[i : i + 1].to(device)
            if i < n_fisher or (n_fisher == 0 and i == 0):
                # the LM loss (and, for Fisher windows, its backward) needs all the logits
                with torch.set_grad_enabled(i < n_fisher):
                    out = model(input_ids=ids, labels=ids, use_cache=False)
                    if i < n_fisher:
                        out.loss.backward()
                losses.append(float(out.loss.detach()))
            else:
                # forward-only windows feed the hooks: no autograd, no vocabulary-sized logits
                with torch.inference_mode():
                    model(input_ids=ids, logits_to_keep=1, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return Captured(keys, values, fk, fv, qsum, count["diag"], qdense, count["dense"], N,
                    sum(losses) / max(1, len(losses)), queries, qpost, N * (Hq // H) if post_rope_queries else 0)

"""Salient tokens in the HF cache (issue 14): the state a :class:`sglang_tasq.hf.cache.QuantizedKVCache`
keeps them by (the echo rows of the layers up to the deciding one, the kept flags, the blocks
decided) and the hooks that hand it each layer's queries, which a transformers ``Cache`` never
sees. The rule is :mod:`sglang_tasq.salient`'s streaming one, the server's."""
from __future__ import annotations

import sys
import weakref
from collections import Counter

import torch

from .. import salient as sal
from ..windows import window_columns


class SalientState:
    """Salient tokens of one cache (module docstring): the echo rows of the layers up to the
    deciding one (fp16 [B, H, cap] each), the kept flags ([B, cap] bool) and the blocks decided."""

    def __init__(self, spec: "sal.SalientSpec", sink: int, recent: int):
        if spec.block is None or not spec.shared:
            raise ValueError(f"the HF cache keeps salient tokens by the streaming rule the server runs "
                             f"(one shared set, decided per block), got {spec}")
        spec.check_windows(sink, recent)
        self.spec, self.sink, self.recent = spec, sink, recent
        self.echo: dict[int, torch.Tensor] = {}
        self.kept: torch.Tensor | None = None
        self.decided = 0
        self.queries: dict[int, tuple] = {}  # layer -> (post-RoPE q [B, Hq, n, d], scaling), from the tap

    @staticmethod
    def _room(t: torch.Tensor | None, shape, T: int, dtype, device) -> torch.Tensor:
        if t is not None and t.shape[-1] >= T:
            return t
        grown = torch.zeros(*shape, max(T, 2 * (0 if t is None else t.shape[-1]), 256), dtype=dtype, device=device)
        if t is not None:
            grown[..., : t.shape[-1]] = t
        return grown

    def step(self, layer, T0: int, T1: int) -> None:
        """After ``layer`` (a :class:`sglang_tasq.hf.cache.QuantizedKVLayer`) appended the tokens
        [T0, T1): score their echo (layers up to the deciding one); at the deciding layer, decide
        every block the scored tokens reach."""
        spec, lid = self.spec, layer.layer_idx
        if lid > spec.layer:
            return
        got = self.queries.pop(lid, None)
        keys = layer.bufs["k"]  # [B, H, T1, d]: exact inside the windows (and kept), the new tokens exact
        B, H = keys.shape[:2]
        if got is None or got[0].shape[0] != B or got[0].shape[2] != T1 - T0:
            raise RuntimeError(f"tasq: the salient cache has no queries of layer {lid} for this forward "
                               f"({T1 - T0} new tokens): build it with model= (the model it is used with) so its "
                               f"attention modules are read")
        q, scale = got
        dev = keys.device
        cols = window_columns(T0, T1, self.sink, self.recent).to(dev)
        pos = torch.arange(T0, T1, device=dev)
        rows = self.echo[lid] = self._room(self.echo.get(lid), (B, H), T1, torch.float16, dev)
        for r in range(B):
            e = sal.query_echo(q[r].transpose(0, 1), keys[r][:, cols].transpose(0, 1), pos, cols,
                               self.sink, self.recent, scale)
            rows[r, :, T0:T1] = e.T.to(torch.float16)
        self.kept = self._room(self.kept, (B,), T1, torch.bool, dev)
        k = sal.decided_blocks(T1, spec)
        if lid == spec.layer and k > self.decided:
            for r in range(B):
                X = torch.cat([self.echo[i][r, :, :T1] for i in range(spec.layer + 1)])
                self.kept[r, sal.decide_blocks(X.float().cpu(), T1, self.decided, self.sink, spec).to(dev)] = True
            self.decided = k

    def kept_between(self, layer_idx: int, a: int, b: int) -> torch.Tensor | None:
        """[B, b - a] bool: the positions layer ``layer_idx`` keeps exact (None before the deciding layer)."""
        if layer_idx < self.spec.layer or self.kept is None:
            return None
        return self.kept[:, a:b]

    def nbytes(self, T: int) -> Counter:
        out: Counter = Counter()
        out["echo"] = sum(int(t[..., :T].numel()) * t.element_size() for t in self.echo.values())
        if self.kept is not None:
            out["salient_pos"] = int(self.kept[:, :T].sum()) * sal.POSITION_BITS // 8
        return out


class QueryTap:
    """Hooks on a model's attention modules (layers ``0 .. last``) that hand each forward's
    post-RoPE queries to a :class:`SalientState`: ``q_proj``'s output, the module's ``q_norm`` if
    it has one, and the rotation of the module's own ``apply_rotary_pos_emb`` with the
    ``position_embeddings`` the layer is called with (HF's query, bit for bit). The state is held
    weakly; :meth:`remove` takes the hooks off."""

    def __init__(self, model: torch.nn.Module, state: SalientState, last: int):
        found = {m.layer_idx: m for m in model.modules()
                 if isinstance(getattr(m, "q_proj", None), torch.nn.Module)
                 and isinstance(getattr(m, "layer_idx", None), int)}
        missing = [i for i in range(last + 1) if i not in found]
        if missing:
            raise ValueError(f"tasq: salient tokens read the queries of layers 0..{last}; {type(model).__name__} has no "
                             f"attention module with q_proj for layer(s) {missing}")
        self.handles: list = []
        ref = weakref.ref(state)
        for i in range(last + 1):
            self._tap(found[i], ref)

    def _tap(self, attn: torch.nn.Module, ref) -> None:
        rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if rope is None:
            raise ValueError(f"tasq: {type(attn).__name__}'s module has no apply_rotary_pos_emb: "
                             "cannot read its queries")
        seen: dict = {}

        def before(mod, args, kwargs):
            seen["pe"] = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)

        def after(lin, inputs, out):
            state, pe = ref(), seen.pop("pe", None)
            if state is None or pe is None:
                return
            q = out.view(*out.shape[:-1], -1, attn.head_dim)
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            q = q.transpose(1, 2)
            state.queries[attn.layer_idx] = (rope(q, q, *pe)[0], float(attn.scaling))

        self.handles.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        self.handles.append(attn.q_proj.register_forward_hook(after))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

"""A transformers ``Cache`` that stores what the serving pool stores (paper sec. 4.4-4.5):
packed codes, the fp16 shared scale, and full-precision sink/recent windows.

HF hands ``update`` post-RoPE keys ``[B, H, n, d]`` and (in 5.x) no cos/sin: positions are
the cache indices (no padding). Pre-RoPE methods (TaSQ) get keys turned back with HF's own
cos/sin (float32 angles cast to the key dtype); decoded keys are rotated by ``apply_rope``. Every token is encoded at insertion; a token is read back at full
precision while it is among the first ``sink`` or the last ``recent`` tokens (or in the
partial block a block method has not coded yet), and from its codes once it leaves.

Stored state (what ``memory_bytes`` counts): payloads (codes + scales), method state, fp
windows. Compute cache (not counted): a model-dtype buffer ``[B, H, T, d]`` of each token's
attended value (fp in the windows, decoded + rotated outside), so a token is decoded once,
when it leaves the window, and attention gets a view (decoding all codes every step costs
~0.6 s a layer at 8k tokens on CPU).

``fresh_exact=True`` (default, like a serving engine's prefill): the forward call that
inserts tokens attends to them at full precision; they are read from codes from the next
call on. ``False``: read from codes at once (fake-quant perplexity in one forward).

Salient tokens (``salient``: a streaming :class:`sglang_tasq.salient.SalientSpec`, the rule the
server keeps them by, issue 14): ``Cache.update`` sees keys only, so the cache reads each
layer's queries through hooks on the model's attention modules (:class:`salient_cache.QueryTap`, given
``model``). At every layer up to the deciding one, ``update`` scores the new tokens' echo
(:func:`sglang_tasq.salient.query_echo` over the exact keys of the window rule, stored fp16 per
(layer, KV head) as the pool does); at the deciding layer it decides every block the scored
tokens reach (:func:`sglang_tasq.salient.decide_blocks`) before that layer's keys are read back,
and from that layer on a kept token keeps its full-precision key and value when it leaves the
windows. Every decision falls before its tokens leave the recent window
(``SalientSpec.check_windows``), so no exact value is needed after it is gone. Fed one token
at a time, the cache reads what the server reads (the per-query window rule, the same echo);
stored bytes count the kept copies, their positions and the echo rows.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .. import codec
from .. import salient as sal
from numba_kernels import fastpath
from .baselines import Identity, KVMethod, SideQuantizer
from .salient_cache import QueryTap, SalientState
from ..codec import Codebooks
from ..rope import apply_rope, rotate


_Nearest = fastpath.layer_nearest  # each layer's codebook prepared once (== codec.nearest_codeword up to float ties)


class _TaSQSide:
    """Packed rows of one token's codes (all heads, code n = h*G + j) and their unpacking."""

    block, exact = 1, False

    def __init__(self):
        # Numba kernels or plain torch, chosen once (SGLANG_TASQ_CPU_KERNELS), tested equal
        self.pack_fn, self.unpack_fn = fastpath.packer(), fastpath.unpacker()

    def _pack(self, codes: torch.Tensor, bits: int) -> dict:
        return {"codes": self.pack_fn(codes.reshape(codes.shape[0], -1), bits)}

    def _unpack(self, payload: dict, codebook: torch.Tensor, bits: int) -> torch.Tensor:
        """``codebook``: the layer's [H, G, K, g]."""
        H, G = codebook.shape[:2]
        T = payload["codes"].shape[0]
        return self.unpack_fn(payload["codes"], H * G, bits).view(T, H, G)


class TaSQKeys(_TaSQSide):
    """TaSQ keys (pre-RoPE): payload codes [T, ceil(H*Gk*bits/8)] uint8 and the fp16
    scale [T] (shared) or [T, H] (per-head ablation). encode == codec.encode_keys, packed.
    An artifact with ``key_rope == 'post'`` (NovaKV) codes the keys as cached, after RoPE."""

    def __init__(self, cb: Codebooks, name: str = "tasq"):
        super().__init__()
        self.cb, self.name, self.nearest = cb, name, _Nearest(cb.tailored_k_codebook)
        self.pre_rope = cb.config.key_rope == "pre"
        self.inv_freq, self.attention_scaling = cb.inv_freq, cb.attention_scaling

    def encode(self, x, layer, state):
        xt, scale = codec.key_tailor(x, self.cb, layer)
        out = self._pack(self.nearest(xt, layer), self.cb.config.code_bits_k_at(layer))
        return out if scale is None else {**out, "scale": scale}

    def decode(self, payload, layer, state):
        codes = self._unpack(payload, self.cb.k_codebook[layer], self.cb.config.code_bits_k_at(layer))
        return codec.decode_keys(codes, payload.get("scale"), self.cb, layer)

    def bits_per_element(self, num_kv_heads, head_dim):
        return self.cb.config.bits_k_mean(num_kv_heads, head_dim, self.cb.num_layers)


class TaSQValues(_TaSQSide):
    """TaSQ values: payload codes [T, ceil(H*Gv*bits/8)] uint8. encode == codec.encode_values."""

    pre_rope = False

    def __init__(self, cb: Codebooks, name: str = "tasq"):
        super().__init__()
        self.cb, self.name, self.nearest = cb, name, _Nearest(lambda layer: cb.v_codebook[layer])

    def encode(self, x, layer, state):
        T, H, d = x.shape
        g = self.cb.config.group_size_v
        return self._pack(self.nearest(x.float().view(T, H, d // g, g), layer), self.cb.config.code_bits_v)

    def decode(self, payload, layer, state):
        codes = self._unpack(payload, self.cb.v_codebook[layer], self.cb.config.code_bits_v)
        return codec.decode_values(codes, self.cb, layer)

    def bits_per_element(self, num_kv_heads, head_dim):
        return self.cb.config.bits_v(num_kv_heads, head_dim)


class PerLayer:
    """One side quantizer in some layers and another in the rest (a layer-adaptive rate, issue 14
    item 2): ``hi`` codes the layers in ``layers``, ``base`` every other one. Both must read
    keys the same way (pre- or post-RoPE, block, exactness); bits are the mean over layers."""

    _SAME = ("pre_rope", "block", "exact", "positional")

    def __init__(self, base, hi, layers, num_layers: int, name: str = ""):
        layers = frozenset(int(i) for i in layers)
        if not layers or min(layers) < 0 or max(layers) >= num_layers:
            raise ValueError(f"layers {sorted(layers)}: each must be in [0, {num_layers})")
        bad = [a for a in self._SAME if getattr(base, a, False) != getattr(hi, a, False)]
        if bad:
            raise ValueError(f"the two quantizers of a layer mix differ in {bad}")
        self.base, self.hi, self.layers, self.num_layers = base, hi, layers, num_layers
        self.name = name or f"{base.name}+{hi.name}"
        for a in self._SAME + ("inv_freq", "attention_scaling"):
            if hasattr(base, a):
                setattr(self, a, getattr(base, a))

    def _of(self, layer):
        return self.hi if layer in self.layers else self.base

    def encode(self, x, layer, state, **kw):
        return self._of(layer).encode(x, layer, state, **kw)

    def decode(self, payload, layer, state):
        return self._of(layer).decode(payload, layer, state)

    def bits_per_element(self, num_kv_heads, head_dim):
        n = len(self.layers)
        return (n * self.hi.bits_per_element(num_kv_heads, head_dim)
                + (self.num_layers - n) * self.base.bits_per_element(num_kv_heads, head_dim)) / self.num_layers


def unrotate_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq, scaling: float = 1.0) -> torch.Tensor:
    """Post-RoPE keys [T, H, d] (HF, dtype of k) -> pre-RoPE keys [T, H, d] float32, using
    cos/sin exactly as HF's rotary module makes them (float32 angles cast to k's dtype)."""
    ang = positions.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = ((f(ang) * scaling).to(k.dtype).float()[:, None] for f in (torch.cos, torch.sin))
    return rotate(k.float(), cos, sin, inverse=True)


def held_copies(x: torch.Tensor, T0: int, exact_format: str | None, keys: SideQuantizer | None = None,
                coder: SideQuantizer | None = None, layer: int = 0, state: dict | None = None,
                coded: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens x [B, H, n, d] at positions T0.. as an exact side buffer of ``exact_format`` holds
    them, in x's dtype: None keeps x; "bf16" rounds it to bf16; "fp8" holds each (token, head) row
    as fp8 e4m3 with an fp16 scale (:func:`salient.fp8_rows`); "res4" ("res2") as the token's codes
    plus a 4-bit (2-bit) residual (:func:`salient.res4_rows`, :func:`salient.res2_rows`: ``coder``, the side's quantizer, gives the codes'
    reading, at ``layer`` with ``state``; or ``coded`` [B, n, H, d], that reading already made).
    Keys (``keys`` given: the method's key quantizer) are held pre-RoPE, as the serving pool
    stores them, when the method codes them so."""
    if exact_format is None:
        return x
    sal.copy_bits(exact_format, x.shape[-1])  # a bad format fails here
    if exact_format in sal.RESIDUAL_FORMATS:
        if coder is None or coder.block != 1 or getattr(coder, "positional", False):
            raise ValueError(f"exact_format={exact_format!r} completes each token's own codes: it needs a "
                             f"quantizer that codes tokens one by one (got {getattr(coder, 'name', None)!r})")
        st = {} if state is None else state

        def hold(t, b):  # t [n, H, d]: as the side codes it (pre-RoPE keys where it codes those)
            if coder.exact:  # a side kept as it is (keys=False / values=False): nothing to complete
                return t
            c = coded[b] if coded is not None else coder.decode(coder.encode(t, layer, st), layer, st)
            return sal.residual_rows(exact_format, t, c)
    elif exact_format == "bf16":
        def hold(t, b):
            return t.to(torch.bfloat16).float()
    else:
        def hold(t, b):
            return sal.fp8_rows(t)
    rope = keys is not None and getattr(keys, "pre_rope", False)
    pos = torch.arange(T0, T0 + x.shape[2], device=x.device)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        t = x[b].transpose(0, 1).float()  # [n, H, d]
        if rope:
            t = unrotate_keys(t, pos, keys.inv_freq, keys.attention_scaling)
        t = hold(t, b)
        if rope:
            t = apply_rope(t, pos, keys.inv_freq, keys.attention_scaling)
        out[b] = t.transpose(0, 1).to(x.dtype)
    return out


class _Payload:
    """A growing dict of tensors (amortized doubling along dim 0)."""

    def __init__(self):
        self.t: dict[str, torch.Tensor] = {}
        self.n = 0

    def append(self, p: dict) -> None:
        m = next(iter(p.values())).shape[0]
        for k, v in p.items():
            buf = self.t.get(k)
            if buf is None or buf.shape[0] < self.n + m:
                new = v.new_empty((max(2 * self.n, self.n + m, 16), *v.shape[1:]))
                if buf is not None:
                    new[: self.n] = buf[: self.n]
                self.t[k] = buf = new
            buf[self.n : self.n + m] = v
        self.n += m

    def slice(self, a: int, b: int) -> dict:
        return {k: v[a:b] for k, v in self.t.items()}

    def nbytes(self) -> dict:
        return {k: v[: self.n].nbytes for k, v in self.t.items()}


class _Side:
    """One side (keys or values) of one layer: payloads per batch row, counters, state."""

    def __init__(self, q: SideQuantizer, batch: int, sink: int):
        self.q, self.rows = q, [_Payload() for _ in range(batch)]
        self.coded = 0  # tokens [0, coded) are encoded
        self.read_upto = sink  # slots [sink, read_upto) hold decoded values
        self.state: dict = {}


class QuantizedKVLayer(DynamicLayer):
    """One layer. ``keys``/``values`` expose the attended buffer view [B, H, T, d]."""

    is_croppable = False

    def __init__(self, cache: "QuantizedKVCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx, self.length = cache, layer_idx, 0

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        B = key_states.shape[0]
        m, s = self.cache.method, self.cache.sink
        self.sides = {"k": _Side(m.keys, B, s), "v": _Side(m.values, B, s)}
        self._base, self.bufs = {}, {}  # attended buffers [B, H, cap, d] and their [:T] views
        self.is_initialized = True

    def _grow(self, name: str, new: torch.Tensor) -> None:
        """Append new [B, H, n, d] to the attended buffer (amortized doubling)."""
        base, T0, n = self._base.get(name), self.length, new.shape[2]
        if base is None or base.shape[2] < T0 + n:
            grown = new.new_empty((*new.shape[:2], max(2 * T0, T0 + n, 64), new.shape[3]))
            if base is not None:
                grown[:, :, :T0] = base[:, :, :T0]
            base = self._base[name] = grown
        base[:, :, T0 : T0 + n] = new
        self.bufs[name] = base[:, :, : T0 + n]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T0, n = self.length, key_states.shape[2]
        self._grow("k", key_states)
        self._grow("v", value_states)
        self.length = T1 = T0 + n
        for name, side in self.sides.items():  # encode at insertion (from the model's values) ...
            self._encode(name, side, T1)
        fmt = self.cache.exact_format
        if fmt is not None:  # ... then hold the exact copies as the server's store does
            for name, x in (("k", key_states), ("v", value_states)):
                side = self.sides[name]
                coded = None
                if fmt in sal.RESIDUAL_FORMATS and not side.q.exact:  # the codes just made, as read
                    coded = torch.stack([side.q.decode(store.slice(T0, T1), self.layer_idx, side.state)
                                         for store in side.rows])
                self.bufs[name][:, :, T0:T1] = held_copies(x, T0, fmt, side.q if name == "k" else None,
                                                           coder=side.q, layer=self.layer_idx, state=side.state,
                                                           coded=coded)
        if self.cache.salient_state is not None:  # echo of the new tokens; decisions at the deciding layer
            self.cache.salient_state.step(self, T0, T1)
        for name, side in self.sides.items():  # ... decode on leaving windows
            self._read_back(name, side, T1, T0 if self.cache.fresh_exact else T1)
        self.keys, self.values = self.bufs["k"], self.bufs["v"]
        return self.keys, self.values

    def _encode(self, name: str, side: _Side, T1: int) -> None:
        blk = side.q.block
        a, b = side.coded, (T1 // blk) * blk
        if b <= a:
            return
        pos = torch.arange(a, b, device=self.device)
        for r, store in enumerate(side.rows):
            x = self.bufs[name][r, :, a:b].transpose(0, 1)  # [T, H, d] model dtype
            if name == "k" and side.q.pre_rope:
                x = unrotate_keys(x, pos, side.q.inv_freq, side.q.attention_scaling)
            kw = {"positions": pos} if getattr(side.q, "positional", False) else {}
            store.append(side.q.encode(x, self.layer_idx, side.state, **kw))
        side.coded = b

    def _read_back(self, name: str, side: _Side, T1: int, bound: int) -> None:
        """Overwrite slots that left the windows (and are coded) with their decoded value."""
        if side.q.exact:
            return
        a, b, blk = side.read_upto, min(side.coded, T1 - self.cache.recent, bound), side.q.block
        if b <= a:
            return
        st = self.cache.salient_state
        keep = None if st is None else st.kept_between(self.layer_idx, a, b)
        for r, store in enumerate(side.rows):
            n0, n1 = a // blk, -(-b // blk)  # whole blocks holding [a, b)
            kw = {"positions": torch.arange(n0 * blk, n1 * blk, device=self.device)} \
                if getattr(side.q, "positional", False) else {}
            x = side.q.decode(store.slice(n0, n1), self.layer_idx, side.state, **kw)
            x = x[a - n0 * blk :][: b - a]
            if name == "k" and side.q.pre_rope:
                pos = torch.arange(a, b, device=self.device)
                x = apply_rope(x, pos, side.q.inv_freq, side.q.attention_scaling)
            x = x.transpose(0, 1).to(self.dtype)
            if keep is not None and bool(keep[r].any()):  # a kept token keeps its exact value
                x = torch.where(keep[r][None, :, None], self.bufs[name][r, :, a:b], x)
            self.bufs[name][r, :, a:b] = x
        side.read_upto = b

    def get_seq_length(self) -> int:
        return self.length

    def memory_bytes(self, windows: bool = True) -> Counter:
        """Stored bytes of this layer by kind: payload entries, 'state', 'window'."""
        out: Counter = Counter()
        if not self.is_initialized:
            return out
        B, H, T, d = self.bufs["k"].shape
        per_row = H * d * self.bufs["k"].element_size()
        if self.cache.exact_format is not None:  # the exact copies as held: bf16, or fp8 + fp16 scale per head
            per_row = int(H * d * sal.copy_bits(self.cache.exact_format, d)) // 8
        sink, st = self.cache.sink, self.cache.salient_state
        for side in self.sides.values():
            for store in side.rows:
                out.update(store.nbytes())
            out["state"] += sum(t.nbytes for t in side.state.values())
            if side.q.exact:
                continue
            hi = max(sink, min(side.coded, T - self.cache.recent))  # [sink, hi): read from codes
            if windows:  # fp tokens: sink, recent window, uncoded partial block
                out["window"] += (T - (hi - sink)) * B * per_row
            keep = None if st is None else st.kept_between(self.layer_idx, sink, hi)
            if keep is not None:  # kept tokens outside the windows: their exact copies
                out["salient"] += int(keep.sum()) * per_row
        return out

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("QuantizedKVLayer does not support crop (no rollback of codes)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("QuantizedKVLayer does not support beam search")

    batch_repeat_interleave = batch_select_indices = reorder_cache


class QuantizedKVCache(Cache):
    """HF cache running any :class:`KVMethod` with full-precision sink/recent windows, and salient
    tokens kept exact when given a streaming ``salient`` spec and the ``model`` whose queries
    choose them (module docstring).

    Example::

        cache = QuantizedKVCache(baseline("kivi2"), sink=0, recent=0)
        model.generate(ids, past_key_values=cache, max_new_tokens=32)
        cache.bytes_per_token()
    """

    def __init__(self, method: KVMethod, sink: int = 64, recent: int = 256, fresh_exact: bool = True,
                 salient: "sal.SalientSpec | None" = None, model: torch.nn.Module | None = None,
                 exact_format: str | None = None):
        if sink < 0 or recent < 0:
            raise ValueError(f"windows must be >= 0, got sink={sink} recent={recent}")
        if exact_format is not None:
            sal.copy_bits(exact_format, 64)  # a bad format fails here
            blocked = [method.keys.block, method.values.block]
            if max(blocked) > 1:
                raise ValueError(f"exact_format={exact_format!r} with {method.name}: a method that codes tokens in "
                                 f"blocks ({max(blocked)}) would code some from their held copies")
        super().__init__(layers=[])
        self.method, self.sink, self.recent, self.fresh_exact = method, sink, recent, fresh_exact
        self.exact_format = exact_format
        self.salient_state = None
        if salient is not None:
            if model is None:
                raise ValueError("tasq: salient tokens are chosen by each layer's queries, which a transformers "
                                 "cache does not see: pass model= (the model this cache is used with)")
            self.salient_state = SalientState(salient, sink, recent)
            self._tap = QueryTap(model, self.salient_state, salient.layer)
            weakref.finalize(self, self._tap.remove)

    def close(self) -> None:
        """Take the query hooks off the model (also done when the cache is garbage collected)."""
        if self.salient_state is not None:
            self._tap.remove()

    def kept_positions(self, row: int = 0) -> torch.Tensor:
        """Ascending positions of batch row ``row`` kept exact (salient tokens decided so far)."""
        st = self.salient_state
        if st is None or st.kept is None:
            return torch.empty(0, dtype=torch.long)
        return torch.nonzero(st.kept[row, : self.get_seq_length()]).flatten().cpu()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(QuantizedKVLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states)

    def memory_breakdown(self, windows: bool = True) -> dict:
        """Stored bytes over all layers by kind ('codes', 'scale', 'zero', 'x', 'state', 'window';
        with salient tokens 'salient' (exact copies outside the windows), 'salient_pos', 'echo')."""
        out = sum((layer.memory_bytes(windows) for layer in self.layers), Counter())
        if self.salient_state is not None:
            out.update(self.salient_state.nbytes(self.get_seq_length()))
        return dict(out)

    def memory_bytes(self, windows: bool = True) -> int:
        """Real stored bytes: payloads (codes + scales) + method state + fp windows (+ salient tokens)."""
        return sum(self.memory_breakdown(windows).values())

    def bytes_per_token(self, windows: bool = True) -> float:
        """memory_bytes / cached tokens (all layers, keys + values, per sequence row)."""
        T = self.get_seq_length()
        B = self.layers[0].bufs["k"].shape[0] if self.layers and self.layers[0].is_initialized else 1
        return self.memory_bytes(windows) / max(1, T * B)


class TaSQCache(QuantizedKVCache):
    """TaSQ/CQ/ablation artifact in an HF cache; ``keys=False`` / ``values=False`` keep that
    side in the model dtype (error-localization rows).

    An artifact that keeps salient tokens (``config.salient_budget``) keeps them here too, by the
    same rule as the server: pass ``model=`` (the cache reads its queries), or ``salient=False``
    for the windows alone (an ablation, chosen by name: never a silent fallback). An artifact whose
    server holds its exact copies as fp8 or res4 (``config.exact_format``) has them held so here too
    (``exact_format=`` overrides: None keeps the model's dtype).

    ``sink`` / ``recent`` default to the artifact's windows (``config.sink_window`` /
    ``recent_window``, set by ``calibrate serving --sink/--recent``), the ones its server keeps, so
    that one artifact reads the same here and there; an int overrides."""

    def __init__(self, codebooks: Codebooks, sink: int | None = None, recent: int | None = None, keys: bool = True,
                 values: bool = True, fresh_exact: bool = True, model: torch.nn.Module | None = None,
                 salient: bool | None = None, exact_format: str | None = "artifact"):
        sink = codebooks.config.sink_window if sink is None else sink
        recent = codebooks.config.recent_window if recent is None else recent
        spec = codebooks.config.salient_spec()
        if salient and spec is None:
            raise ValueError("tasq: salient=True but this artifact keeps no salient tokens (salient_budget 0)")
        use = spec is not None if salient is None else salient
        if use and model is None:
            c = codebooks.config
            raise ValueError(f"tasq: this artifact keeps salient tokens ({c.salient_budget} of every {c.salient_block} "
                             f"positions, decided at layer {c.salient_layer}) chosen by each layer's queries: "
                             f"TaSQCache(codebooks, model=model) reads them, or salient=False keeps the windows only")
        method = KVMethod(TaSQKeys(codebooks) if keys else Identity(),
                          TaSQValues(codebooks) if values else Identity(), "tasq")
        if exact_format == "artifact":  # bf16 copies stay in the model's dtype (the cache's default)
            exact_format = codebooks.config.exact_format if codebooks.config.exact_format != "bf16" else None
        super().__init__(method, sink, recent, fresh_exact, salient=spec if use else None, model=model,
                         exact_format=exact_format)
        self.codebooks = codebooks

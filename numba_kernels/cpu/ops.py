"""Host-side launch objects of the CPU kernels: :class:`DecodeTables` (one layer's codebooks
as the decode kernel reads them), :class:`DecodePlan` (a decode step's per-forward arguments,
reused by every layer) and :func:`decode_attention` (a one-layer plan), and
:class:`PoolEncoder` (the fused pool encode of one layer's new tokens).
"""
from __future__ import annotations

import numpy as np
import torch

from sglang_tasq.packing import SCALE_MODE_ID, packed_row_bytes, scales_per_token
from sglang_tasq.salient import FP8_VALUES

from ._common import _NO_RING, _SERIAL_BELOW, _arr, _as_f32, _np, _u16
from .decode import _decode_attention, _res4_keys
from .encode import _encode_small, _tailor_keys, _write_rows
from .search import _ARGMIN_CHUNK, _search, prepare

_NO_KEPT = np.zeros(0, np.uint8)  # no kept slots (the window rule alone)
_NO_SCALES = np.zeros((1, 1), np.uint16)  # bf16 exact entries: no per-entry scales
_NO_LUT = np.zeros(0, np.float32)  # ... and no fp8 code table
_NO_ECHO = np.zeros((0, 1), np.float32)  # no salient echo asked
_NO_MISS = np.zeros(0, np.int64)
_NO_BOOK = np.zeros((1, 1, 1, 1), np.float32)  # not a res4 write: no raw codebook to complete
# float8_e4m3fn code -> its value (the fp8 exact store's entries are code x fp16 scale)
FP8_LUT = FP8_VALUES.numpy()
# res4 nibble -> its step (nibble - 8): a res4 entry is the slot's codes + step x fp16 scale
RES4_LUT = np.arange(16, dtype=np.float32) - np.float32(8)
WIN_FORMATS = ("bf16", "fp8", "res4")
SPLIT_TOKENS = 256  # positions per split-K range of the decode kernel
ROPE_COMPOSE_TOL = 1e-3  # |table - composed| / m allowed where the decode kernel composes RoPE rows


def rope_composes(cos: np.ndarray, sin: np.ndarray, chunk: int, length: int) -> bool:
    """Whether the RoPE tables (float32 [rows, d/2]) are a rotation table, ``cos[t] = m cos(t
    theta)``, ``sin[t] = m sin(t theta)`` (m > 0: attention scaling), over positions
    0..length-1, so the decode kernel may rotate position t0 + i by R_t0 R_i / m (t0 a split's
    first position, a multiple of ``chunk``): one gather of the first ``chunk`` rows per layer
    instead of one per token. Checked on every split start and, after each, the positions 1,
    chunk / 2 and chunk - 1 on, within :data:`ROPE_COMPOSE_TOL` of m (float32 rows of angles
    computed in float64 compose to ~1e-6; fp32 angles at t ~ 8k are themselves ~5e-4 off).
    A table that is not one (no such m, another position dependence) keeps the per-token
    gather."""
    n = min(length, cos.shape[0])
    if n == 0:
        return False
    m = cos[0].astype(np.float64)
    if not ((sin[0] == 0).all() and (m > 0).all()):
        return False
    t0 = np.arange(0, n, chunk)
    off = np.array(sorted({1, chunk // 2, chunk - 1} - {0}))
    t0, off = np.broadcast_arrays(t0[:, None], off[None, :])
    keep = t0 + off < n
    t0, off = t0[keep], off[keep]
    if not t0.size:
        return True

    def rows(tab, t):  # the probed rows only, in float64
        return tab[t].astype(np.float64)

    cc = (rows(cos, t0) * rows(cos, off) - rows(sin, t0) * rows(sin, off)) / m
    ss = (rows(sin, t0) * rows(cos, off) + rows(cos, t0) * rows(sin, off)) / m
    err = max(float(np.abs(cc - rows(cos, t0 + off)).max()), float(np.abs(ss - rows(sin, t0 + off)).max()))
    return err <= ROPE_COMPOSE_TOL * float(m.max())


class DecodeTables:
    """One layer's codebooks as the decode kernel reads them (float32 numpy): the tailored key
    codebook (codewords times the diagonal weights, :meth:`Codebooks.tailored_k_codebook`)
    with the weights in the permuted layout, and the value codebook.

    ``prepared``: the :class:`PoolEncoder`'s ``(keys, values)`` :func:`prepare` output of this
    layer; the tables then are views of the encoder's codeword rows, so a decode step's encode
    and attention read one copy of each codebook (on a CPU the codebooks of 30 layers do not
    stay in cache, and the decode kernel is bound by those reads). Zero weights (never from
    calibration) fall back to the raw key codebook with unit weights."""

    def __init__(self, cb, layer: int, prepared=None):
        if cb.k_unmix is not None:
            raise NotImplementedError("the CPU decode kernel serves diagonal (or no) key weighting; "
                                      "the dense-weighting ablation uses the reference path")
        H, G, K, g = cb.k_codebook[layer].shape
        # this layer's key code width and row bytes (a per-layer key rate, config.mix_layers)
        self.bits_k = cb.config.code_bits_k_at(layer)
        self.code_bytes_k = packed_row_bytes(H * G, self.bits_k)
        self.kperm = cb.k_perm[layer].detach().to(torch.int64).contiguous().numpy()
        w = torch.gather(cb.k_weight[layer].detach().float(), 1, cb.k_perm[layer].detach().to(torch.int64))
        if bool((w != 0).all()):
            if prepared is None:
                prepared = (prepare(cb.tailored_k_codebook(layer)), prepare(cb.v_codebook[layer]))
            self.kcb = prepared[0][2].reshape(H, G, K, g)
            self.kw = w.contiguous().numpy()
        else:
            self.kcb = cb.k_codebook[layer].detach().float().contiguous().numpy()
            self.kw = np.ones((H, G * g), np.float32)
        v = cb.v_codebook[layer]
        self.vcb = (prepared[1][2].reshape(tuple(v.shape)) if prepared is not None
                    else v.detach().float().contiguous().numpy())


class DecodePlan:
    """The per-forward arguments of :func:`decode_attention` (request layout, windows, RoPE
    tables, split-K buffers), converted once and reused by every layer of a decode step.

    kv_indptr [B+1] / kv_indices: request b's tokens (positions 0..S_b-1) sit at slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; cos/sin [>= max S, d/2] float32 RoPE tables
    (attention scaling included); entry_of [slots] int64: each slot's exact-store entry (0 =
    none; read through a view, so entries assigned after the plan is built are seen), None
    without windows. Position t of request b is read exactly (from its slot's entry) iff it is
    in the window of S_b (:func:`sglang_tasq.windows.in_window`) or its slot is kept (the
    per-call ``kept`` of :meth:`__call__`), and the slot has an entry; from codes otherwise.
    split_tokens: positions per split-K range (default
    :data:`SPLIT_TOKENS`); fixed, not chosen from the batch, so every request gets the same
    floating-point answer alone or in any batch. code_bytes_k: the key code bytes per row every
    layer has, checked against each layer's tables; None: each layer's own
    (:attr:`DecodeTables.code_bytes_k`; a per-layer key rate, ``config.mix_layers``).
    """

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, cfg, code_bytes_k: int | None,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                 entry_of: torch.Tensor | None = None, split_tokens: int | None = None):
        self.cfg, self.code_bytes_k = cfg, code_bytes_k
        self.indptr = kv_indptr.to(torch.int64).contiguous().numpy()
        self.indices = kv_indices.to(torch.int64).contiguous().numpy()
        B = self.B = len(self.indptr) - 1
        Hq, H, d = self.shape = num_q_heads, num_kv_heads, head_dim
        self.cos = cos.float().contiguous().numpy()
        self.sin = sin.float().contiguous().numpy()
        if entry_of is None:
            self.entry_of = np.zeros(0, np.int64)
        else:
            if entry_of.dtype != torch.int64 or not entry_of.is_contiguous():
                raise TypeError("entry_of must be a contiguous int64 tensor (it is read through a view)")
            self.entry_of = entry_of.numpy()
        self.slots = int(self.indices.max()) + 1 if self.indices.shape[0] else 0  # kept covers slots 0..this-1
        max_len = int((self.indptr[1:] - self.indptr[:-1]).max()) if B else 0
        self.chunk = int(split_tokens or SPLIT_TOKENS)
        if self.chunk < 1:
            raise ValueError(f"split_tokens must be >= 1, got {split_tokens}")
        ns = self.nsplit = max(1, -(-max_len // self.chunk))
        rep = Hq // H
        self.part_m = np.empty((B * H * ns, rep), np.float32)
        self.part_l = np.empty((B * H * ns, rep), np.float32)
        self.part_o = np.empty((B * H * ns, rep, d), np.float32)
        self._echo_parts = None  # the salient echo's per-split buffers, made on the first call that asks
        self.scale_mode = SCALE_MODE_ID[cfg.scale]
        self.composed = rope_composes(self.cos, self.sin, self.chunk, max_len)

    def __call__(self, q: torch.Tensor, k_rows, v_rows, tables: DecodeTables, sm_scale: float,
                 win_k=None, win_v=None, kept=None, win_scales=None, win_format: str | None = None,
                 echo_span: tuple[int, int] | None = None):
        """One layer: q [B, Hq, d] post-RoPE queries (request b at position ``S_b - 1``);
        k_rows [rows, Bk+Bs] and v_rows [rows, Bv] uint8 pool buffers; win_k/win_v [E + 1, 1, H, d]
        bfloat16 pre-RoPE exact entries (tensors, or their uint16 numpy views); kept: this
        layer's kept (salient) slots, a contiguous uint8 or bool tensor (or numpy array) of
        length >= max slot + 1, non-zero = kept: a kept slot with an entry is read exactly at
        any position, besides the window (given per call: layers may differ; read through a
        view). None: none kept (the window rule alone); ignored without windows. win_scales: for
        an fp8 exact store (``config.exact_format``), (key scales, value scales) [E + 1, H] fp16
        (or their uint16 numpy views), win_k/win_v then uint8 float8_e4m3fn codes. win_format:
        the store's ``exact_format`` ("bf16", "fp8" or "res4": win_k/win_v [E + 1, 1, H, d / 2]
        uint8 residual nibbles over each slot's codes, with win_scales); None: fp8 with
        win_scales, else bf16.
        echo_span: [lo, hi) positions (:func:`sglang_tasq.salient.echo_span`): also each
        request's salient window echo, from the same logits (:func:`sglang_tasq.salient.query_echo`
        of its query: the softmax over the window positions only, its mass on [lo, hi), summed
        over each KV head's query heads); needs the windows (an exact store), and every window
        position must hold an entry (RuntimeError otherwise, as a window read from codes).
        -> [B, Hq, d] f32, or with echo_span (that, echo [B, H] f32)."""
        fmt = win_format or ("fp8" if win_scales is not None else "bf16")
        if fmt not in WIN_FORMATS:
            raise ValueError(f"window entry format {fmt!r}: allowed {WIN_FORMATS}")
        if (fmt != "bf16") != (win_scales is not None) and win_k is not None:
            raise ValueError(f"{fmt} window entries {'need' if fmt != 'bf16' else 'take no'} win_scales")
        B, (Hq, H, d) = self.B, self.shape
        if tuple(q.shape) != (B, Hq, d):
            raise ValueError(f"decode plan: q has shape {tuple(q.shape)}, planned for {(B, Hq, d)}")
        out = np.empty((B, Hq, d), np.float32)
        if echo_span is not None and (win_k is None or not self.entry_of.shape[0]):
            raise ValueError("the salient echo reads the window entries: no exact store given")
        if not B:
            return torch.from_numpy(out) if echo_span is None else (torch.from_numpy(out), torch.zeros(0, H))
        wks = wvs = _NO_SCALES
        lut = _NO_LUT
        if win_k is None or not self.entry_of.shape[0]:
            wk = wv = _NO_RING[0]
        elif fmt != "bf16":
            if fmt == "res4" and d % 4:
                raise ValueError(f"res4 window entries need head_dim a multiple of 4 (the kernel reads a "
                                 f"byte of each half of a RoPE pair at once), got {d}")
            for w in (win_k, win_v):
                if isinstance(w, torch.Tensor) and w.dtype != torch.uint8:
                    raise TypeError(f"{fmt} window entries must be uint8 codes, got {w.dtype}")
                if w.shape[-1] != (d // 2 if fmt == "res4" else d):
                    raise ValueError(f"{fmt} window entries of width {w.shape[-1]} for head_dim {d}")
            wk, wv = _arr(win_k, torch.Tensor.numpy), _arr(win_v, torch.Tensor.numpy)
            wks, wvs = (_arr(t, _u16) for t in win_scales)
            lut = FP8_LUT if fmt == "fp8" else RES4_LUT
        else:
            for w in (win_k, win_v):
                if isinstance(w, torch.Tensor) and w.dtype != torch.bfloat16:
                    raise TypeError(f"window entries must be bfloat16, got {w.dtype}")
            wk, wv = _arr(win_k, _u16), _arr(win_v, _u16)
        kp = _NO_KEPT if kept is None else self._kept(kept)
        if wk is _NO_RING[0]:  # no windows: codes everywhere, kept or not
            kp = _NO_KEPT
        cfg = self.cfg
        if self.code_bytes_k is not None and tables.code_bytes_k != self.code_bytes_k:
            raise ValueError(f"decode plan: planned for {self.code_bytes_k} key code bytes per row, the layer's "
                             f"tables have {tables.code_bytes_k}")
        if echo_span is None:
            lo = hi = 0
            pw = (self.part_m, self.part_m, self.part_m, _NO_MISS)  # (not written)
            echo = _NO_ECHO
        else:
            lo, hi = (int(x) for x in echo_span)
            if self._echo_parts is None:
                items = self.part_m.shape[0]
                self._echo_parts = tuple(np.empty_like(self.part_m) for _ in range(3)) + (np.zeros(items, np.int64),)
            pw = self._echo_parts
            echo = np.empty((B, H), np.float32)
        _decode_attention(q.detach().float().contiguous().numpy(), _arr(k_rows, torch.Tensor.numpy),
                          _arr(v_rows, torch.Tensor.numpy), self.indptr, self.indices, tables.kcb, tables.kperm,
                          tables.kw, tables.vcb, tables.bits_k, cfg.code_bits_v, tables.code_bytes_k, self.scale_mode,
                          self.cos, self.sin, self.composed, self.entry_of, kp, wk, wv, wks, wvs, lut,
                          cfg.sink_window, cfg.recent_window, np.float32(sm_scale), self.chunk, self.nsplit,
                          self.part_m, self.part_l, self.part_o, out, lo, hi, *pw, echo)
        if echo_span is None:
            return torch.from_numpy(out)
        if pw[3].any():
            raise RuntimeError(f"tasq: {int(pw[3].sum())} window keys of the salient echo have no exact entry")
        return torch.from_numpy(out), torch.from_numpy(echo)

    def _kept(self, kept) -> np.ndarray:
        """``kept`` as the kernel reads it: a uint8 numpy view (no copy) of a contiguous uint8 or
        bool tensor / array covering every slot of the plan."""
        if isinstance(kept, torch.Tensor):
            if kept.dtype not in (torch.uint8, torch.bool) or kept.dim() != 1 or not kept.is_contiguous():
                raise TypeError(f"kept must be a contiguous 1-D uint8 or bool tensor (it is read through a view), "
                                f"got {kept.dtype} {tuple(kept.shape)}")
            kp = kept.view(torch.uint8).numpy()
        elif isinstance(kept, np.ndarray):
            if kept.dtype not in (np.uint8, np.bool_) or kept.ndim != 1 or not kept.flags.c_contiguous:
                raise TypeError(f"kept must be a contiguous 1-D uint8 or bool array (it is read through a view), "
                                f"got {kept.dtype} {kept.shape}")
            kp = kept.view(np.uint8)
        else:
            raise TypeError(f"kept must be a uint8 or bool tensor or None, got {type(kept).__name__}")
        if kp.shape[0] and kp.shape[0] < self.slots:
            raise ValueError(f"kept has {kp.shape[0]} slots, the plan reads slots up to {self.slots - 1}")
        return kp


def decode_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, tables: DecodeTables, cfg, code_bytes_k: int,
                     cos: torch.Tensor, sin: torch.Tensor, sm_scale: float,
                     entry_of: torch.Tensor | None = None, win_k: torch.Tensor | None = None,
                     win_v: torch.Tensor | None = None, split_tokens: int | None = None,
                     win_scales=None, win_format: str | None = None) -> torch.Tensor:
    """Decode attention of one layer over packed codes, all requests in one call (a one-layer
    :class:`DecodePlan`; see it for the arguments; win_k/win_v [E + 1, H, d] or [E + 1, 1, H, d];
    win_scales: an fp8 store's (key, value) scales [E + 1, H]). Returns [B, Hq, d] f32."""
    B, Hq, d = q.shape
    plan = DecodePlan(kv_indptr, kv_indices, cfg, code_bytes_k, Hq, tables.kcb.shape[0], d, cos, sin,
                      entry_of.to(torch.int64).contiguous() if entry_of is not None else None, split_tokens)
    if win_k is not None and win_k.dim() == 3:
        win_k, win_v = win_k.unsqueeze(1), win_v.unsqueeze(1)
    return plan(q, k_rows, v_rows, tables, sm_scale, win_k if entry_of is not None else None,
                win_v if entry_of is not None else None, win_scales=win_scales, win_format=win_format)


class PoolEncoder:
    """Encode one layer's new tokens straight into a TaSQ pool (keys un-rotated, tailored,
    coded, packed; values coded, packed; window tokens copied to their bf16 exact entries).

    Equals the pool's reference path (``rope.apply_rope(inverse) -> codec.key_tailor ->
    codec.nearest_codeword -> packing.pack_codes``) up to float rounding: the shared scale's
    mean is summed in float64 (fp16 result equal but for rare rounding-boundary cases) and
    the argmin has :func:`nearest`'s tie caveat."""

    def __init__(self, cb):
        if cb.k_mix is not None:
            raise NotImplementedError("the CPU pool encoder serves diagonal (or no) key weighting; "
                                      "the dense-weighting ablation uses the reference path")
        self.cb, self.cfg, self.layers, self.raw_books = cb, cb.config, {}, {}

    def _layer(self, layer: int):
        tab = self.layers.get(layer)
        if tab is None:
            cb = self.cb
            tab = self.layers[layer] = (
                cb.k_weight[layer].detach().float().contiguous().numpy(),
                cb.k_perm[layer].detach().to(torch.int64).contiguous().numpy(),
                prepare(cb.tailored_k_codebook(layer)), prepare(cb.v_codebook[layer]))
        return tab

    def _raw(self, layer: int):
        """(key, value) codebooks of ``layer`` as the reference decode reads them (un-tailored
        keys), float32 numpy: what a res4 window write completes."""
        raw = self.raw_books.get(layer)
        if raw is None:
            cb = self.cb
            raw = self.raw_books[layer] = tuple(t[layer].detach().float().contiguous().numpy()
                                                for t in (cb.k_codebook, cb.v_codebook))
        return raw

    def res4_keys(self, layer: int, ent: torch.Tensor, owner: torch.Tensor, k_rows, code_bytes_k: int,
                  win_k, win_ks) -> torch.Tensor:
        """Pre-RoPE keys [n, H, d] f32 of res4 exact entries ``ent`` [n] of ``layer`` (``owner``
        [E + 1] entry -> slot; ``k_rows`` the layer's packed key rows; ``win_k`` [E + 1, 1, H, d / 2]
        uint8, ``win_ks`` [E + 1, H] fp16 or their numpy views): ``ExactStore.read_k`` of a res4
        store in one Numba call, bit for bit (what the salient echo reads each step)."""
        kraw, _ = self._raw(layer)
        _, kperm, _, _ = self._layer(layer)
        H, Gk, _, gk = kraw.shape
        out = np.empty((ent.shape[0], H, Gk * gk), np.float32)
        _res4_keys(_np(ent, torch.int64), _np(owner, torch.int64), _arr(k_rows, torch.Tensor.numpy), code_bytes_k,
                   self.cfg.code_bits_k_at(layer), kraw, kperm, _arr(win_k, torch.Tensor.numpy), _arr(win_ks, _u16), out)
        return torch.from_numpy(out)

    def prepared(self, layer: int):
        """(keys, values) :func:`prepare` output of ``layer`` (for :class:`DecodeTables`)."""
        _, _, kprep, vprep = self._layer(layer)
        return kprep, vprep

    def encode_into(self, layer: int, k_post: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor, k_rows: torch.Tensor,
                    v_rows: torch.Tensor, code_bytes_k: int, wring: torch.Tensor | None = None,
                    widx: torch.Tensor | None = None, win_k: torch.Tensor | None = None,
                    win_v: torch.Tensor | None = None, win_scales=None, win_format: str | None = None) -> bool:
        """k_post/v [T, H, d] (any float dtype), positions [T] (< len(cos)), loc [T] slots of
        k_rows/v_rows (uint8 pool buffers, written in place); optional window targets wring [T]
        (exact-store entry, 0 = none) and widx [T] (0) into bf16 entries win_k/win_v [E + 1, 1, H, d]
        (tensors or uint16 numpy views; the pool passes views made once), or with ``win_scales``
        (key, value scales [E + 1, H] fp16, or their uint16 views) into an fp8 store: win_k/win_v
        uint8 float8_e4m3fn codes (:func:`sglang_tasq.salient.fp8_encode`, bit for bit), or with
        ``win_format="res4"`` (and ``win_scales``) into a res4 store: win_k/win_v [E + 1, 1, H, d / 2]
        uint8, what the codes just written read as by the reference decode, completed in 4-bit
        steps (:func:`sglang_tasq.salient.res4_encode` over ``pool.read_codes``, bit for bit).

        Returns False, having written nothing, when a tailored key or a value is not finite
        (the caller then uses the reference path, whose argmin defines that case)."""
        cfg = self.cfg
        T, H, d = k_post.shape
        if T == 0:
            return True
        for buf in (k_rows, v_rows, win_k, win_v):
            if buf is not None and not (buf.flags.c_contiguous if isinstance(buf, np.ndarray) else buf.is_contiguous()):
                raise ValueError("PoolEncoder writes in place: pool buffers must be contiguous")
        w, kperm, kprep, vprep = self._layer(layer)
        gk, gv = self.cb.key_group_size(layer), cfg.group_size_v
        bits_k = cfg.code_bits_k_at(layer)
        kf, vf = _np(k_post, torch.float32), _np(v, torch.float32)
        pos, locn = _np(positions, torch.int64), _np(loc, torch.int64)
        cosn, sinn = _arr(cos, _as_f32), _arr(sin, _as_f32)
        kb, vb = _arr(k_rows, torch.Tensor.numpy), _arr(v_rows, torch.Tensor.numpy)
        Hs = scales_per_token(cfg, H)
        fmt = win_format or ("fp8" if win_scales is not None else "bf16")
        if fmt not in WIN_FORMATS:
            raise ValueError(f"window format {fmt!r}: allowed {WIN_FORMATS}")
        if wring is not None and (fmt != "bf16") != (win_scales is not None):
            raise ValueError(f"{fmt} window entries with{'out' if win_scales is None else ''} scales: "
                             f"bf16 takes none, fp8 and res4 their (key, value) scales")
        wfmt = {"bf16": 0, "fp8": 1, "res4": 2}[fmt] if wring is not None else 0  # 1, 2: uint8 entries + scales
        kraw = vraw = _NO_BOOK
        if wfmt == 2:
            if d % 2:
                raise ValueError(f"res4 window entries need an even head_dim, got {d}")
            kraw, vraw = self._raw(layer)
        wks = wvs = _NO_SCALES
        if wring is None:
            wr, wi = np.zeros(T, np.int64), np.zeros(T, np.int64)
            wk = wv = _NO_RING[0]
        elif wfmt:
            wr, wi = _np(wring, torch.int64), _np(widx, torch.int64)
            wk, wv = _arr(win_k, torch.Tensor.numpy), _arr(win_v, torch.Tensor.numpy)
            wks, wvs = (_arr(t, _u16) for t in win_scales)
        else:
            wr, wi = _np(wring, torch.int64), _np(widx, torch.int64)
            wk, wv = _arr(win_k, _u16), _arr(win_v, _u16)
        if T < _SERIAL_BELOW:  # a decode step: one call
            return _encode_small(kf, vf, pos, cosn, sinn, w, kperm, SCALE_MODE_ID[cfg.scale], gk, gv,
                                  kprep[2], kprep[1], vprep[2], vprep[1], _ARGMIN_CHUNK, bits_k,
                                  cfg.code_bits_v, code_bytes_k, Hs, locn, kb, vb, wr, wi, wk, wv, wfmt, wks, wvs,
                                  kraw, vraw)
        kpre = np.empty((T, H, d), np.float32)
        x = np.empty((T, H * (d // gk), gk), np.float32)
        sbits = np.zeros((T, Hs), np.uint16)
        _tailor_keys(kf, pos, cosn, sinn, w, kperm, SCALE_MODE_ID[cfg.scale], gk, kpre, x, sbits)
        if not (np.isfinite(x).all() and np.isfinite(vf).all()):
            return False
        kcodes = np.empty((T, x.shape[1]), np.int32)
        vcodes = np.empty((T, H * (d // gv)), np.int32)
        _search(x, kprep, kcodes)
        _search(vf.reshape(T, H * (d // gv), gv), vprep, vcodes)
        _write_rows(kcodes, sbits, vcodes, bits_k, cfg.code_bits_v, code_bytes_k,
                    locn, kb, vb, kpre, vf, wr, wi, wk, wv, wfmt, wks, wvs, kraw, kperm, vraw)
        return True

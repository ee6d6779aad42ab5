"""The TaSQ artifact: ``tasq.json`` (manifest) + ``tasq.safetensors`` (tensors). No pickle.

One loader, :func:`load_artifact`, validates everything and raises :class:`ArtifactError`
naming the field: format version, missing/truncated tensors file (size and sha256 are in the
manifest), shapes against the manifest and against a served model, NaN/Inf, permutations
that split a RoPE pair, codebook sizes, bit accounting.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .codec import Codebooks
from .config import ConfigError, TaSQConfig

FORMAT = "tasq-artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "tasq.json"
TENSORS_NAME = "tasq.safetensors"


class ArtifactError(ValueError):
    """A TaSQ artifact is malformed or does not match the model. The message names the field."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What an artifact must agree with in the served model."""

    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Optional[dict]
    rope_style: str = "rotate_half"
    has_k_norm: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Fields that differ, as 'field: artifact X, model Y' lines."""
        out = []
        for f in ("num_layers", "num_kv_heads", "num_q_heads", "head_dim", "rope_style", "has_k_norm"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"model.{f}: artifact has {a}, model has {b}")
        if not math.isclose(float(self.rope_theta), float(other.rope_theta), rel_tol=1e-6):
            out.append(f"model.rope_theta: artifact has {self.rope_theta}, model has {other.rope_theta}")
        if (self.rope_scaling or None) != (other.rope_scaling or None):
            out.append(f"model.rope_scaling: artifact has {self.rope_scaling}, model has {other.rope_scaling}")
        return out


@dataclass
class Artifact:
    manifest: dict
    codebooks: Codebooks
    path: Path

    @property
    def config(self) -> TaSQConfig:
        return self.codebooks.config

    @property
    def model(self) -> ModelFingerprint:
        return ModelFingerprint(**self.manifest["model"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_artifact(out_dir, cb: Codebooks, model: ModelFingerprint, calibration: dict,
                  extra: Optional[dict] = None) -> Path:
    """Write DIR/tasq.safetensors and DIR/tasq.json; returns the manifest path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = cb.config
    tensors = {
        **_key_codebook_tensors(cb),
        "k.weight": cb.k_weight.float().contiguous(),
        "k.perm": cb.k_perm.to(torch.int32).contiguous(),
        "v.codebook": cb.v_codebook.float().contiguous(),
        "rope.inv_freq": cb.inv_freq.float().contiguous(),
    }
    if cb.k_mix is not None:
        tensors["k.mix"] = cb.k_mix.float().contiguous()
        tensors["k.unmix"] = cb.k_unmix.float().contiguous()
    if cb.k_mean is not None:
        tensors["k.mean"] = cb.k_mean.float().contiguous()
    tpath = out / TENSORS_NAME
    tmp = tpath.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, tpath)
    H, d = model.num_kv_heads, model.head_dim
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": model.to_dict(),
        "config": cfg.to_dict(),
        "group_size_k": cfg.group_size_k,
        "group_size_v": cfg.group_size_v,
        "codebook_size_k": cfg.codebook_size_k,
        "codebook_size_v": cfg.codebook_size_v,
        "code_bits_k": cfg.code_bits_k,
        "code_bits_v": cfg.code_bits_v,
        "windows": {"sink": cfg.sink_window, "recent": cfg.recent_window},
        "bits_k": round(cfg.bits_k_mean(H, d, model.num_layers), 6),
        "bits_v": round(cfg.bits_v(H, d), 6),
        "attention_scaling": cb.attention_scaling,
        "calibration": calibration,
        "tensors": {"file": TENSORS_NAME, "bytes": tpath.stat().st_size, "sha256": _sha256(tpath)},
    }
    if extra:
        manifest.update(extra)
    mpath = out / MANIFEST_NAME
    mpath.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return mpath


def _key_codebook_tensors(cb: Codebooks) -> dict:
    """``k.codebook`` [L, ...]; with a per-layer key rate, ``k.codebook`` stacks the layers at the
    config's rate and ``k.codebook.mix`` those in ``config.mix_layers`` (in that order)."""
    if not cb.layer_mixed:
        return {"k.codebook": cb.k_codebook.float().contiguous()}
    mix = set(cb.config.mix_layers)
    return {"k.codebook": torch.stack([cb.k_codebook[l] for l in range(cb.num_layers) if l not in mix]).float().contiguous(),
            "k.codebook.mix": torch.stack([cb.k_codebook[l] for l in sorted(mix)]).float().contiguous()}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ArtifactError(msg)


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    _require(tuple(t.shape) == tuple(shape), f"tensor {name}: shape {tuple(t.shape)}, expected {tuple(shape)}")


def load_artifact(path, model: Optional[ModelFingerprint] = None) -> Artifact:
    """Load and validate an artifact from its manifest path (or the directory holding it).

    With ``model`` given, the artifact must match it (layers, KV heads, head_dim, RoPE).
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    _require(p.is_file(), f"manifest: no such file {p}")
    try:
        manifest = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"manifest: {p} is not valid JSON ({e})") from None
    _require(isinstance(manifest, dict), "manifest: top level must be a JSON object")
    _require(manifest.get("format") == FORMAT, f"format: expected {FORMAT!r}, got {manifest.get('format')!r}")
    _require(manifest.get("format_version") == FORMAT_VERSION,
             f"format_version: this sglang-tasq reads version {FORMAT_VERSION}, artifact has {manifest.get('format_version')!r}")
    for key in ("model", "config", "tensors", "bits_k", "bits_v", "calibration", "windows"):
        _require(key in manifest, f"{key}: missing from manifest")
    try:
        cfg = TaSQConfig.from_dict(manifest["config"])
    except (ConfigError, TypeError) as e:
        raise ArtifactError(f"config: {e}") from None
    try:
        fp = ModelFingerprint(**manifest["model"])
    except TypeError as e:
        raise ArtifactError(f"model: {e}") from None
    L, H, d = fp.num_layers, fp.num_kv_heads, fp.head_dim
    _require(L > 0 and H > 0 and d > 0 and d % 2 == 0, f"model: bad dimensions layers={L} kv_heads={H} head_dim={d}")
    _require(fp.num_q_heads % H == 0, f"model.num_q_heads: {fp.num_q_heads} is not a multiple of num_kv_heads={H}")
    try:
        cfg.check_head_dim(d)
        cfg.check_kv_heads(H)
        cfg.check_layers(L)
    except ConfigError as e:
        raise ArtifactError(f"config: {e}") from None
    for key in ("group_size_k", "group_size_v", "codebook_size_k", "codebook_size_v", "code_bits_k", "code_bits_v"):
        _require(manifest.get(key) == getattr(cfg, key),
                 f"{key}: manifest says {manifest.get(key)!r}, config implies {getattr(cfg, key)!r}")
    for key, want in (("bits_k", cfg.bits_k_mean(H, d, L)), ("bits_v", cfg.bits_v(H, d))):
        _require(isinstance(manifest[key], (int, float)) and abs(manifest[key] - want) < 1e-4,
                 f"{key}: manifest says {manifest[key]!r}, the configuration gives {want:.6f}")
    if model is not None:
        bad = fp.mismatches(model)
        _require(not bad, "artifact does not match the model: " + "; ".join(bad))

    tinfo = manifest["tensors"]
    tpath = p.parent / str(tinfo.get("file", TENSORS_NAME))
    _require(tpath.is_file(), f"tensors.file: missing {tpath}")
    size = tpath.stat().st_size
    _require(size == tinfo.get("bytes"), f"tensors.bytes: file {tpath.name} has {size} bytes, manifest says "
             f"{tinfo.get('bytes')} (truncated or replaced)")
    _require(_sha256(tpath) == tinfo.get("sha256"), f"tensors.sha256: {tpath.name} does not match the manifest checksum")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        t = load_file(str(tpath))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ArtifactError(f"tensors.file: cannot read {tpath.name} ({e})") from None

    Gk, Gv = d // cfg.group_size_k, d // cfg.group_size_v
    n_mix = len(cfg.mix_layers)
    expect = {
        "k.codebook": (L - n_mix, H, Gk, cfg.codebook_size_k, cfg.group_size_k),
        "k.weight": (L, H, d),
        "k.perm": (L, H, d),
        "v.codebook": (L, H, Gv, cfg.codebook_size_v, cfg.group_size_v),
        "rope.inv_freq": (d // 2,),
    }
    if n_mix:
        gm = cfg.mix_group_size_k
        expect["k.codebook.mix"] = (n_mix, H, d // gm, cfg.mix_codebook_size_k, gm)
    if cfg.mixes_keys:
        expect["k.mix"] = (L, H, d, d)
        expect["k.unmix"] = (L, H, d, d)
    if cfg.weighting == "qpca":
        expect["k.mean"] = (L, H, d)
    _require("k.codebook.mix" in expect or "k.codebook.mix" not in t,
             "tensor k.codebook.mix: present, but config.mix_layers is empty (a per-layer key rate needs the layers)")
    for name, shape in expect.items():
        _require(name in t, f"tensor {name}: missing from {tpath.name}")
        _check_shape(name, t[name], shape)
        if t[name].is_floating_point():
            _require(bool(torch.isfinite(t[name]).all()), f"tensor {name}: contains NaN or Inf")
    w = t["k.weight"]
    _require(bool((w > 0).all()), "tensor k.weight: weights must be positive")
    if cfg.weighting == "diag":
        msq = w.pow(2).mean(-1)
        _require(bool(((msq - 1).abs() < 1e-3).all()), f"tensor k.weight: mean(w^2) must be 1 per head, got {msq.min():.4f}..{msq.max():.4f}")
    perm = t["k.perm"].long()
    mix = list(cfg.mix_layers)
    base = [l for l in range(L) if l not in cfg.mix_layers]
    check_permutation(perm[base], cfg.group_size_k, cfg.grouping, layers=base)
    if mix:
        check_permutation(perm[mix], cfg.mix_group_size_k, cfg.grouping, layers=mix)
    k_codebook = t["k.codebook"]
    if mix:  # one tensor per layer, each at its layer's rate
        per = dict(zip(base, t["k.codebook"])) | dict(zip(mix, t["k.codebook.mix"]))
        k_codebook = tuple(per[l] for l in range(L))
    inv_freq = t["rope.inv_freq"]
    _require(bool((inv_freq > 0).all()), "tensor rope.inv_freq: must be positive")

    cb = Codebooks(config=cfg, k_codebook=k_codebook, k_weight=w, k_perm=perm,
                   v_codebook=t["v.codebook"], inv_freq=inv_freq,
                   attention_scaling=float(manifest.get("attention_scaling", 1.0)),
                   k_mix=t.get("k.mix"), k_unmix=t.get("k.unmix"),
                   k_mean=t.get("k.mean") if cfg.weighting == "qpca" else None)
    return Artifact(manifest=manifest, codebooks=cb, path=p)


def check_permutation(perm: torch.Tensor, g: int, grouping: str = "covariance", layers=None) -> None:
    """perm [L, H, d]: a permutation per head whose groups hold whole RoPE pairs in the
    canonical in-group layout (channel l < g/2 pairs with l + g/2); for grouping 'channels'
    (CQ's native channel groups) the identity; for 'stratified' (NovaKV) the fixed map
    permuted channel ``j*g + i`` <- coefficient ``i*G + j``."""
    L, H, d = perm.shape
    half = d // 2
    sorted_ = torch.sort(perm, dim=-1).values
    _require(bool((sorted_ == torch.arange(d)).all()), "tensor k.perm: not a permutation of the head's channels")
    if grouping == "channels":
        _require(bool((perm == torch.arange(d)).all()), "tensor k.perm: grouping 'channels' needs the identity permutation")
        return
    if grouping == "stratified":
        from .codec import stratified_permutation

        _require(bool((perm == stratified_permutation(d, g)).all()),
                 "tensor k.perm: grouping 'stratified' needs coefficient i*G + j at permuted channel j*g + i")
        return
    grp = perm.view(L, H, d // g, g)
    first, second = grp[..., : g // 2], grp[..., g // 2 :]
    ok = (first < half) & (second == first + half)
    if not bool(ok.all()):
        l, h, j, _ = [int(x) for x in torch.nonzero(~ok)[0]]
        grp = grp[l]
        l = layers[l] if layers is not None else l
        raise ArtifactError(f"tensor k.perm: layer {l} head {h} group {j} splits a RoPE pair "
                            f"(channels {grp[h, j].tolist()})")

"""The methods the quality harness compares, by name, and where each one's artifact comes from.

Names (``parse``):

* closed-form: ``bf16``, ``fp8_e4m3``, ``kivi2`` (:mod:`sglang_tasq.hf.baselines`);
* calibrated (one artifact each, made by ``python -m calibrate`` when missing): ``cq``
  (Coupled Quantization as published at TaSQ's rate: channel groups, Fisher-weighted k-means),
  ``cq_pairs`` (CQ on whole-RoPE-pair groups with unweighted k-means: this project's CQ before
  issue 13, and the servable form), ``tasq`` and the ablations ``tasq_no_weighting``,
  ``tasq_no_shared_scale``, ``tasq_no_grouping``, ``tasq_no_fisher``,
  ``tasq_dense_weighting``;
* error localization on the ``tasq`` artifact: ``tasq_keys_only`` (values stay bf16),
  ``tasq_values_only`` (keys stay bf16);
* calibration-free: ``nsnquant`` / ``nsnquant2`` (NSNQuant at 1 / 2 bits: one universal codebook
  fitted on Gaussian samples, :mod:`calibrate.universal`; needs the model's RoPE frequencies);
* post-RoPE: ``novakv`` (NovaKV's published rate: keys 4-dim groups x 256 codewords, values
  rotated INT2) and ``novakv1`` (at TaSQ's rate: keys 8 x 1024, values TaSQ's VQ), each
  from its own ``--method novakv`` artifact (``novakv_g4k256``, ``novakv_g8k1024``);
* rate points: ``cq@g4k256``, ``tasq@g8k16``, ... (group size g, codebook size K, both
  sides), or keys and values apart, ``tasq@g4k256/g8k512`` (keys / values); ``@g8k1024`` is
  the reference rate and reuses the plain ``cq``/``tasq`` artifact;
* layer mixes (issue 14 item 2; :mod:`bench.retrieval`, :mod:`bench.quality`, the server view): ``BASE+HI@L3,7,12`` codes layers 3, 7
  and 12 with method HI's artifact and every other layer with BASE's, e.g.
  ``tasq+tasq@g4k256/g8k1024@L3,7,12`` (both calibrated TaSQ methods of one model).

Artifacts live in ``<root>/<preset>/<artifact_name>/tasq.json`` unless a path is given for
that artifact name (``overrides``). Window settings are ``"none"`` or ``"SINK+RECENT"``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_tasq.hf.baselines import BASELINES, Identity, KVMethod, baseline
from sglang_tasq.config import ABLATIONS

REF_G, REF_K = 8, 1024
ABLATION_METHODS = tuple(f"tasq_{a}" for a in ABLATIONS)
NSN_METHODS = {"nsnquant": 1, "nsnquant2": 2}
# key group, key codebook, value bits (None: the artifact's VQ values, TaSQ's value path)
NOVA_METHODS = {"novakv": (4, 256, 2), "novakv1": (8, 1024, None)}
METHODS = (*BASELINES, "cq", "cq_pairs", "tasq", *ABLATION_METHODS, "tasq_keys_only", "tasq_values_only",
           *NSN_METHODS, *NOVA_METHODS)
_RATE = re.compile(r"^(cq|tasq)@g(\d+)k(\d+)(?:/g(\d+)k(\d+))?$")
_MIX = re.compile(r"^(?P<base>[^+]+)\+(?P<hi>[^+]+)@L(?P<layers>\d+(?:,\d+)*)$")
_TP = re.compile(r"^tasq_tp(\d+)$")  # TaSQ calibrated to serve at TP N (key scale per rank's heads)


@dataclass(frozen=True)
class MethodSpec:
    """One row of the comparison. ``calib`` is None for closed-form methods."""

    name: str
    closed_form: Optional[str] = None  # a baselines.BASELINES name, or an NSN_METHODS one
    calib: Optional[str] = None  # "tasq" | "cq" | "cq_pairs" | "novakv"
    ablation: Optional[str] = None
    group_size: int = REF_G
    codebook_size: int = REF_K
    keys: bool = True  # False: keys stay in the model dtype
    values: bool = True
    tp: int = 1  # the tensor-parallel degree it is calibrated for (``calibrate --tp``)
    group_size_v: Optional[int] = None  # the values' rate when it differs from the keys' (None: the same)
    codebook_size_v: Optional[int] = None

    @property
    def value_rate(self) -> tuple[int, int]:
        return (self.group_size_v or self.group_size, self.codebook_size_v or self.codebook_size)

    @property
    def split_rate(self) -> bool:
        return self.value_rate != (self.group_size, self.codebook_size)

    @property
    def named_rate(self) -> bool:
        """The rate is part of the artifact's name and calibration flags (NovaKV's always is:
        its default key rate is not the reference one)."""
        return ((self.group_size, self.codebook_size) != (REF_G, REF_K) or self.split_rate
                or self.calib == "novakv")

    @property
    def artifact_name(self) -> Optional[str]:
        if self.calib is None:
            return None
        base = self.calib + (f"_{self.ablation}" if self.ablation else "") + (f"_tp{self.tp}" if self.tp > 1 else "")
        rate = f"_g{self.group_size}k{self.codebook_size}" if self.named_rate else ""
        if self.split_rate:
            rate += "_g{}k{}".format(*self.value_rate)
        return base + rate

    def calibrate_argv(self, model: str, preset: str, out: Path) -> list[str]:
        argv = [sys.executable, "-m", "calibrate", "--model", model, "--out", str(out), "--preset", preset,
                "--method", self.calib, "--quiet"]
        if self.ablation:
            argv += ["--ablation", self.ablation]
        if self.split_rate:
            gv, kv = self.value_rate
            argv += ["--group-size-k", str(self.group_size), "--codebook-size-k", str(self.codebook_size),
                     "--group-size-v", str(gv), "--codebook-size-v", str(kv)]
        elif self.named_rate:
            argv += ["--group-size", str(self.group_size), "--codebook-size", str(self.codebook_size)]
        if self.tp > 1:
            argv += ["--tp", str(self.tp)]
        return argv

    def expected_config(self) -> dict:
        """Manifest config fields an artifact for this spec must have."""
        from sglang_tasq.config import TaSQConfig

        cfg = {"cq": TaSQConfig.cq(), "cq_pairs": TaSQConfig.cq_pairs(),
               "novakv": TaSQConfig.novakv()}.get(self.calib, TaSQConfig())
        if self.ablation:
            cfg = cfg.ablation(self.ablation)
        want = {k: getattr(cfg, k) for k in ("weighting", "scale", "grouping", "fisher", "key_rope")}
        if self.tp > 1:  # one scale group per rank (a model with fewer KV heads than ranks: one per head)
            want["scale_groups"] = self.tp
        gv, kv = self.value_rate
        return {**want, "group_size_k": self.group_size, "codebook_size_k": self.codebook_size,
                "group_size_v": gv, "codebook_size_v": kv, "mix_layers": ()}


@dataclass(frozen=True)
class MixSpec:
    """A layer mix: ``hi``'s artifact codes ``layers``, ``base``'s every other layer."""

    name: str
    base: MethodSpec
    hi: MethodSpec
    layers: tuple

    closed_form = None
    artifact_name = None

    @property
    def mixed_artifact_name(self) -> str:
        """The name under which one ``calibrate --mix-layers`` artifact may stand for the two
        (``--artifact NAME=DIR``): ``tasq+tasq_g4k256_g8k1024@L17,18``."""
        return f"{self.base.artifact_name}+{self.hi.artifact_name}@L{','.join(map(str, self.layers))}"

    def expected_config(self) -> dict:
        """Manifest config fields of a mixed artifact that stands for this mix: the base method's,
        with HI's key rate in the listed layers (one value rate: both methods' must agree)."""
        base, hi = self.base.expected_config(), self.hi.expected_config()
        if (base["group_size_v"], base["codebook_size_v"]) != (hi["group_size_v"], hi["codebook_size_v"]):
            raise ValueError(f"layer mix {self.name}: one artifact holds one value rate, and the two methods' differ")
        return {**base, "mix_layers": self.layers, "mix_group_size_k": hi["group_size_k"],
                "mix_codebook_size_k": hi["codebook_size_k"]}


def parse(name: str):
    """A method name -> its spec; unknown names raise ValueError listing the allowed ones."""
    m = _MIX.match(name)
    if m:
        base, hi = parse(m["base"]), parse(m["hi"])
        for part in (base, hi):
            if not isinstance(part, MethodSpec) or part.calib != "tasq" or part.ablation or not (part.keys and part.values):
                raise ValueError(f"layer mix {name!r}: {part.name!r} is not a calibrated TaSQ method (tasq or tasq@gGkK...)")
        layers = tuple(int(i) for i in m["layers"].split(","))
        if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
            raise ValueError(f"layer mix {name!r}: list each layer once, in increasing order")
        return MixSpec(name, base, hi, layers)
    if name in BASELINES or name in NSN_METHODS:
        return MethodSpec(name, closed_form=name)
    if name in NOVA_METHODS:
        g, k, _ = NOVA_METHODS[name]
        return MethodSpec(name, calib="novakv", group_size=g, codebook_size=k)
    if name in ("cq", "cq_pairs", "tasq"):
        return MethodSpec(name, calib=name)
    if name in ABLATION_METHODS:
        return MethodSpec(name, calib="tasq", ablation=name[len("tasq_"):])
    if name == "tasq_keys_only":
        return MethodSpec(name, calib="tasq", values=False)
    if name == "tasq_values_only":
        return MethodSpec(name, calib="tasq", keys=False)
    m = _TP.match(name)
    if m and int(m.group(1)) > 1:
        return MethodSpec(name, calib="tasq", tp=int(m.group(1)))
    m = _RATE.match(name)
    if m:
        gv, kv = (int(m.group(4)), int(m.group(5))) if m.group(4) else (None, None)
        return MethodSpec(name, calib=m.group(1), group_size=int(m.group(2)), codebook_size=int(m.group(3)),
                          group_size_v=gv, codebook_size_v=kv)
    raise ValueError(f"method {name!r}: allowed {METHODS}, rate points like 'tasq@g8k256' (keys / values apart: "
                     "'tasq@g4k256/g8k512') or TP-calibrated "
                     "TaSQ like 'tasq_tp3'")


def split_names(text: str) -> tuple:
    """A comma list of method names -> the names. A layer mix carries commas of its own
    (``tasq+tasq@g4k256/g8k1024@L17,18``), so a bare number after a mix joins that mix's layers."""
    names = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        if part.isdigit() and names and _MIX.match(f"{names[-1]},{part}"):
            names[-1] = f"{names[-1]},{part}"
        else:
            names.append(part)
    return tuple(names)


def parse_windows(setting: str) -> tuple[int, int]:
    """'none' -> (0, 0); '64+256' -> (64, 256)."""
    if setting == "none":
        return 0, 0
    m = re.fullmatch(r"(\d+)\+(\d+)", setting)
    if not m:
        raise ValueError(f"window setting {setting!r}: allowed 'none' or 'SINK+RECENT' such as '64+256'")
    return int(m.group(1)), int(m.group(2))


def artifact_dir(spec: MethodSpec, root: Path, preset: str, overrides: Optional[dict] = None) -> Optional[Path]:
    if spec.artifact_name is None:
        return None
    if overrides and spec.artifact_name in overrides:
        return Path(overrides[spec.artifact_name])
    return Path(root) / preset / spec.artifact_name


def ensure_artifact(spec: MethodSpec, model: str, preset: str, root: Path, overrides: Optional[dict] = None,
                    log=print) -> Optional[Path]:
    """The spec's artifact directory, calibrating it in a subprocess when tasq.json is missing.
    A present artifact whose config disagrees with the spec raises ValueError."""
    out = artifact_dir(spec, root, preset, overrides)
    if out is None:
        return None
    manifest = out / "tasq.json"
    if not manifest.is_file():
        argv = spec.calibrate_argv(model, preset, out)
        log(f"[methods] calibrating {spec.artifact_name}: {' '.join(argv[1:])}")
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0 or not manifest.is_file():
            raise RuntimeError(f"calibration of {spec.artifact_name} failed (rc {res.returncode}): {res.stderr[-2000:]}")
    check_config(manifest, spec, "method")
    return out


def check_config(manifest: Path, spec, what: str) -> None:
    """ValueError naming each field where the artifact's config differs from ``spec.expected_config()``."""
    from sglang_tasq.config import TaSQConfig

    got = {**TaSQConfig().to_dict(), **json.loads(manifest.read_text())["config"]}  # fields older artifacts lack
    got = {k: tuple(v) if isinstance(v, list) else v for k, v in got.items()}  # JSON lists: mix_layers
    bad = {k: (v, got.get(k)) for k, v in spec.expected_config().items() if got.get(k) != v}
    if bad:
        raise ValueError(f"artifact {manifest} does not fit {what} {spec.name}: (want, has) {bad}")


def build(spec: MethodSpec, artifact: Optional[Path] = None, fingerprint=None, rope=None) -> KVMethod:
    """The KVMethod the caches run for this spec (``artifact`` required for calibrated ones;
    ``rope`` = (inv_freq, attention_scaling) of the model for NSNQuant's keys)."""
    if isinstance(spec, MixSpec):
        raise ValueError(f"method {spec.name}: a layer mix is built with prepare(), from its two artifacts")
    if spec.closed_form in NSN_METHODS:
        if rope is None:
            raise ValueError(f"method {spec.name} needs the model's RoPE frequencies (rope=)")
        from calibrate.universal import gaussian_codebook
        from sglang_tasq.hf.nsnquant import nsnquant

        bits = NSN_METHODS[spec.closed_form]
        return nsnquant(gaussian_codebook(orthant=bits == 2), rope[0], rope[1], bits)
    if spec.closed_form:
        return baseline(spec.closed_form)
    if artifact is None:
        raise ValueError(f"method {spec.name} needs an artifact")
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.hf.cache import TaSQKeys, TaSQValues

    cb = load_artifact(artifact, model=fingerprint).codebooks
    if spec.calib == "novakv":
        from sglang_tasq.hf.novakv import novakv

        return novakv(cb, NOVA_METHODS[spec.name][2], spec.name)
    return KVMethod(TaSQKeys(cb) if spec.keys else Identity(), TaSQValues(cb) if spec.values else Identity(), spec.name)


#: config fields ``calibrate serving`` changes without touching the tensors: how a server serves them
SERVING_FIELDS = ("sink_window", "recent_window", "salient_budget", "salient_block", "salient_layer",
                  "salient_after", "exact_format")


def artifact_sha(art: Path) -> str:
    """What run folders pin an artifact by: the sha256 of its tensors, as its ``tasq.json`` records
    it, and, where its serving settings (:data:`SERVING_FIELDS`, written by ``calibrate serving``)
    differ from the defaults, ``+serving:`` and a digest of them (two artifacts sharing tensors but
    served differently, e.g. bf16 and fp8 exact copies, must not share a run's items)."""
    import hashlib

    from sglang_tasq.config import TaSQConfig

    manifest = json.loads((Path(art) / "tasq.json").read_text())
    default, cfg = TaSQConfig(), manifest.get("config", {})
    diff = {k: cfg[k] for k in SERVING_FIELDS if k in cfg and cfg[k] != getattr(default, k)}
    sha = manifest["tensors"]["sha256"]
    if diff:
        sha += "+serving:" + hashlib.sha256(json.dumps(diff, sort_keys=True).encode()).hexdigest()[:16]
    return sha


def short_id(sha: str) -> str:
    """An :func:`artifact_sha` for messages: the tensors' first 12 hex digits, and its serving digest."""
    tensors, _, serving = sha.partition("+")
    return tensors[:12] + (f"+{serving}" if serving else "")


def prepare(spec, model: str, preset: str, root: Path, overrides: Optional[dict] = None, fingerprint=None,
            log=print) -> tuple:
    """(the KVMethod of ``spec``, {artifact name: artifact dir} it reads), calibrating what is missing.
    A layer mix reads two artifacts, which must hold the same number of layers."""
    if not isinstance(spec, MixSpec):
        art = ensure_artifact(spec, model, preset, root, overrides, log)
        return build(spec, art, fingerprint), ({} if art is None else {spec.artifact_name: art})
    from sglang_tasq.hf.cache import PerLayer

    if overrides and spec.mixed_artifact_name in overrides:  # one artifact with a per-layer key rate
        return _mixed_artifact(spec, Path(overrides[spec.mixed_artifact_name]), fingerprint)

    (base, a), (hi, b) = (prepare(s, model, preset, root, overrides, fingerprint, log) for s in (spec.base, spec.hi))
    L = base.keys.cb.num_layers
    if hi.keys.cb.num_layers != L:
        raise ValueError(f"layer mix {spec.name}: the artifacts hold {L} and {hi.keys.cb.num_layers} layers")
    mix = KVMethod(PerLayer(base.keys, hi.keys, spec.layers, L), PerLayer(base.values, hi.values, spec.layers, L),
                   spec.name)
    return mix, {**a, **b}


def _mixed_artifact(spec: MixSpec, out: Path, fingerprint=None) -> tuple:
    """A layer mix from one ``calibrate --mix-layers`` artifact (checked against the mix's
    config), under the mix's name: the codes of the two-artifact mix when both come from one
    capture and seed."""
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.hf.cache import TaSQKeys, TaSQValues

    manifest = out / "tasq.json"
    if not manifest.is_file():
        raise ValueError(f"layer mix {spec.name}: no artifact at {manifest} (--artifact {spec.mixed_artifact_name}=DIR)")
    check_config(manifest, spec, "layer mix")
    cb = load_artifact(out, model=fingerprint).codebooks
    return KVMethod(TaSQKeys(cb), TaSQValues(cb), spec.name), {spec.mixed_artifact_name: out}


def bits(method: KVMethod, num_kv_heads: int, head_dim: int) -> tuple[float, float]:
    """(bits per key element, bits per value element), metadata included."""
    k, v = method.bits(num_kv_heads, head_dim)
    return round(k, 4), round(v, 4)

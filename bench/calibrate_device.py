"""``python -m bench.calibrate_device``: calibration end to end on a device, for a model of a named
shape with random weights (issue 13 item 6): what a user with a GPU and an 8B model waits for.

    python -m bench.calibrate_device --shape llama-3.1-8b --device cuda --preset fast
    python -m bench.calibrate_device --shape llama-3.1-8b --device cuda            # default preset
    python -m bench.calibrate_device --shape tiny --device cpu --preset fast --tokens 4096   # CI

1. The shape's config gets random weights (seeded, std 0.02, bf16) and is saved as an HF checkpoint
   with a tokenizer (``--tokenizer``, default SmolLM2's, whose 49,152 ids fit any vocabulary at
   least that large) in a scratch folder (``--work``, removed afterwards unless ``--keep``).
2. ``python -m calibrate --model CKPT --out WORK/artifact --device DEVICE --preset P [calibrate
   flags]`` runs in a subprocess, timed from the outside: the user's wall time, Python start-up and
   the model load included. Any argument this bench does not know is passed on to calibrate.
3. The artifact is read back with ``load_artifact`` against the checkpoint's fingerprint. It stays
   in the scratch folder (an 8B artifact's codebooks are ~270 MB): its calibration record, with
   every stage's seconds, goes into the results.

Random weights give the real shape's time and memory, never its quality: the held-out errors are
printed only to show the fit ran. Output, in ``--results``/``<shape>_<preset>_<device type>/``:
``metrics.json`` (stage seconds from the artifact's calibration record, wall time, peak device
memory, peak host RSS of the calibration process, device and host names, torch version) and
``summary.md``.

Shapes (:data:`SHAPES`): ``llama-3.1-8b`` (32 layers, 32 query / 8 KV heads of 128 dims, hidden
4,096, MLP 14,336, vocabulary 128,256, llama3 RoPE scaling: 16 GB of bf16 weights), ``tiny``
(2 layers, 4 / 2 heads of 64 dims: the CPU check of this script).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "calibrate_device"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=49152, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_checkpoint(shape: str, out: Path, tokenizer_dir: Path, device: str, seed: int = 0) -> dict:
    """A random-weight LlamaForCausalLM of ``shape`` saved at ``out`` (bf16 safetensors, the
    tokenizer's files beside it) -> {"params": n, "seconds": t}. The weights are drawn on ``device``
    (8B parameters: 16 GB there, no float32 copy)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r}: allowed {sorted(SHAPES)}")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = SHAPES[shape]
    if len(tok) > spec["vocab_size"]:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens, more than the {shape} vocabulary "
                         f"({spec['vocab_size']})")
    cfg = LlamaConfig(**spec, initializer_range=0.02, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"params": n, "seconds": round(time.perf_counter() - t0, 2)}


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    from bench.nearest import cpu_name

    return cpu_name()


def run_calibration(ckpt: Path, out: Path, device: str, preset: str, extra: list) -> dict:
    """``python -m calibrate`` on ``ckpt`` in a subprocess -> its argv, wall seconds and the child's
    peak RSS (raises with the child's stderr tail when it fails)."""
    argv = [sys.executable, "-m", "calibrate", "--model", str(ckpt), "--out", str(out), "--device", device,
            "--preset", preset, "--quiet", *extra]
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[1]))
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"calibration failed (rc {res.returncode}): {' '.join(argv[1:])}\n{res.stderr[-3000:]}")
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    return {"argv": argv[1:], "wall_s": round(wall, 2), "peak_host_rss_gib": round(rss_kib / 2**20, 2)}


def summarize(m: dict) -> str:
    cal = m["calibration"]
    st = cal.get("stage_times_s", {})
    km = cal.get("kmeans", {})
    held = cal.get("heldout", {})
    rows = [("device", m["device_name"]), ("host", m["host"]), ("torch", m["torch"]),
            ("model", f"{m['shape']}, random weights, {m['params'] / 1e9:.2f} B parameters (bf16)"),
            ("preset / flags", " ".join([m["preset"], *m["extra_flags"]])),
            ("calibration tokens", f"{cal['tokens']:,} ({cal.get('fisher_tokens', 0):,} with Fisher)"),
            ("k-means", f"{km.get('points_per_codebook', 0):,} points per codebook, {km.get('iters_min')}-"
                        f"{km.get('iters_max')} iterations, on {km.get('device')}"),
            ("checkpoint build (not calibration)", f"{m['build_s']:.1f} s"),
            ("**calibration wall time** (python -m calibrate, end to end)", f"**{m['wall_s']:.1f} s**"),
            ("stages", "  ".join(f"{k} {v:.1f} s" for k, v in st.items())),
            ("peak device memory", f"{cal['peak_device_memory_gib']:.1f} GiB" if cal.get("peak_device_memory_gib")
             is not None else "-"),
            ("peak host RSS (calibration process)", f"{m['peak_host_rss_gib']:.1f} GiB"),
            ("held-out logit NMSE (random weights: shows the fit ran, not quality)",
             f"{held.get('logit_nmse', float('nan')):.4f}")]
    return "\n".join([f"# Calibration on a device: {m['shape']}, preset {m['preset']}", "",
                      "`python -m bench.calibrate_device " + " ".join(m["bench_argv"]) + "`", "",
                      "| what | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibrate_device", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    ap.add_argument("--preset", choices=("default", "fast"), default="default")
    ap.add_argument("--tokenizer", help="an HF tokenizer directory (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--work", help="scratch folder for the checkpoint (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the artifact in --work")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--seed", type=int, default=0)
    raw = list(sys.argv[1:] if argv is None else argv)
    a, extra = ap.parse_known_args(raw)

    import torch

    from calibrate.pipeline import resolve_device
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.models import fingerprint, load_config, resolve_model

    try:
        dev = resolve_device(a.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = str(dev)
    tokenizer = Path(a.tokenizer) if a.tokenizer else resolve_model("smollm2-135m")
    run_dir = Path(a.results) / f"{a.shape}_{a.preset}_{dev.type}"
    run_dir.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="tasq-calib-device-"))
    ckpt = work / f"{a.shape}-random"
    try:
        if ckpt.exists():
            shutil.rmtree(ckpt)
        print(f"[calibrate_device] building a random-weight {a.shape} checkpoint in {ckpt}", file=sys.stderr)
        built = build_checkpoint(a.shape, ckpt, tokenizer, device, a.seed)
        print(f"[calibrate_device] {built['params'] / 1e9:.2f} B parameters in {built['seconds']:.1f} s; "
              f"calibrating on {device}", file=sys.stderr)
        cal = run_calibration(ckpt, work / "artifact", device, a.preset, extra)
        art = load_artifact(work / "artifact" / "tasq.json", model=fingerprint(load_config(ckpt)))
    finally:
        if not a.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(work / "artifact", ignore_errors=True)
            if not a.work:
                shutil.rmtree(work, ignore_errors=True)
    metrics = {"shape": a.shape, "preset": a.preset, "extra_flags": extra, "bench_argv": raw, "device": device,
               "device_name": device_name(device), "host": f"{platform.node()} ({platform.machine()})",
               "torch": torch.__version__, "params": built["params"], "build_s": built["seconds"],
               "wall_s": cal["wall_s"], "peak_host_rss_gib": cal["peak_host_rss_gib"],
               "calibrate_argv": cal["argv"], "calibration": art.manifest["calibration"]}
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    md = summarize(metrics)
    (run_dir / "summary.md").write_text(md)
    print(md)
    print(f"[calibrate_device] wrote {run_dir / 'metrics.json'} and summary.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

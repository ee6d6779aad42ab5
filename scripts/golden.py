"""Golden outputs of the runtime, to show that a restructure changed no behaviour.

    python scripts/golden.py record DIR   # on the code before the change
    python scripts/golden.py check DIR    # on the code after it: bit-identical or it says where

Records, on the calibrated SmolLM2 artifact (``artifacts/smollm2``) and fixed seeded inputs:
the reference codec (tailored keys, shared scales, key/value codes, packed rows, decoded keys
and values) and its Numba twins (nearest codeword, packing, the fused pool encoder on a decode
step and on a prefill), the CPU decode-attention kernel over a pool with radix-shared slots and
window entries, the HF TaSQ cache's logits on a prompt and greedy steps, and a real SGLang
engine's greedy tokens and log-probs on two prompts (Numba path, and the torch path on one).
Module paths are looked up under their old and new names (before and after the\nsrt/hf/packing restructure).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "smollm2" / "tasq.json"


def _mod(*names):
    for n in names:
        try:
            return importlib.import_module(n)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(names)


def _codec_and_kernels(out: dict) -> None:
    from sglang_tasq import codec
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.rope import cos_sin

    cpu = _mod("numba_kernels.cpu")
    pk = _mod("sglang_tasq.packing", "sglang_tasq.codec")
    art = load_artifact(ARTIFACT)
    cb, cfg = art.codebooks, art.config
    H, d = cb.num_kv_heads, cb.head_dim
    gen = torch.Generator().manual_seed(1234)
    for layer in (0, 13, cb.num_layers - 1):
        k = torch.randn(53, H, d, generator=gen) * 1.7
        v = torch.randn(53, H, d, generator=gen)
        x, scale = codec.key_tailor(k, cb, layer)
        kc = codec.nearest_codeword(x, cb.tailored_k_codebook(layer))
        vc = codec.encode_values(v, cb, layer)
        out[f"ref.L{layer}.x"] = x
        out[f"ref.L{layer}.scale"] = scale
        out[f"ref.L{layer}.kcodes"] = kc
        out[f"ref.L{layer}.vcodes"] = vc
        out[f"ref.L{layer}.kpacked"] = pk.pack_codes(kc.reshape(53, -1), cfg.code_bits_k)
        out[f"ref.L{layer}.vpacked"] = pk.pack_codes(vc.reshape(53, -1), cfg.code_bits_v)
        out[f"ref.L{layer}.kdec"] = codec.decode_keys(kc, scale, cb, layer)
        out[f"ref.L{layer}.vdec"] = codec.decode_values(vc, cb, layer)
        out[f"numba.L{layer}.kcodes"] = cpu.nearest(x, cpu.prepare(cb.tailored_k_codebook(layer)))
        out[f"numba.L{layer}.kpacked"] = cpu.pack(kc.reshape(53, -1).to(torch.int32), cfg.code_bits_k)

    # fused pool encoder (decode-step and prefill paths) into zeroed pool rows
    enc = cpu.PoolEncoder(cb)
    Gk, Gv = d // cfg.group_size_k, d // cfg.group_size_v
    kb = pk.packed_row_bytes(H * Gk, cfg.code_bits_k)
    sbytes = {"shared": 2, "per_head": 2 * H, "none": 0}[cfg.scale]
    cos, sin = cos_sin(torch.arange(4096), cb.inv_freq, cb.attention_scaling)
    for T in (5, 100):
        rows = 256
        k_rows = torch.zeros(rows, kb + sbytes, dtype=torch.uint8)
        v_rows = torch.zeros(rows, pk.packed_row_bytes(H * Gv, cfg.code_bits_v), dtype=torch.uint8)
        kp = torch.randn(T, H, d, generator=gen).to(torch.bfloat16)
        vv = torch.randn(T, H, d, generator=gen).to(torch.bfloat16)
        pos = torch.randperm(3000, generator=gen)[:T]
        loc = torch.randperm(rows - 1, generator=gen)[:T] + 1
        ok = enc.encode_into(3, kp, vv, pos, cos, sin, loc, k_rows, v_rows, kb)
        assert ok
        out[f"encode.T{T}.k_rows"] = k_rows
        out[f"encode.T{T}.v_rows"] = v_rows

    # decode attention over a pool: request 1 shares request 0's first 40 slots; window entries
    layer = 7
    seq_lens = [1, 77, 700, 5, 333]
    total = sum(seq_lens)
    rows = total + 9
    slots = torch.randperm(rows - 1, generator=gen)[:total] + 1
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    slots[starts[2]:starts[2] + 40] = slots[starts[1]:starts[1] + 40].clone()  # a radix-shared prefix
    k_pre = torch.randn(total, H, d, generator=gen)
    v = torch.randn(total, H, d, generator=gen)
    x, scale = codec.key_tailor(k_pre, cb, layer)
    kc = codec.nearest_codeword(x, cb.tailored_k_codebook(layer))
    vc = codec.encode_values(v, cb, layer)
    krow = pk.pack_codes(kc.reshape(total, -1), cfg.code_bits_k)
    if scale is not None:
        krow = torch.cat([krow, scale.reshape(total, -1).contiguous().view(torch.uint8)], 1)
    k_rows = torch.zeros(rows, krow.shape[1], dtype=torch.uint8)
    v_rows = torch.zeros(rows, pk.packed_row_bytes(H * Gv, cfg.code_bits_v), dtype=torch.uint8)
    k_rows[slots] = krow
    v_rows[slots] = pk.pack_codes(vc.reshape(total, -1), cfg.code_bits_v)
    sink, recent = cfg.sink_window, cfg.recent_window
    keep = []
    for b, S in enumerate(seq_lens):
        for p in range(S):
            s = int(slots[starts[b] + p])
            if (p < sink or p >= S - recent) and s % 5 and s not in keep:
                keep.append(s)
    E = len(keep) + 2
    entry_of = torch.zeros(rows, dtype=torch.int64)
    entry_of[torch.tensor(keep)] = torch.randperm(E, generator=gen)[:len(keep)] + 1
    wk = torch.randn(E + 1, H, d, generator=gen).to(torch.bfloat16)
    wv = torch.randn(E + 1, H, d, generator=gen).to(torch.bfloat16)
    Hq = 9
    q = torch.randn(len(seq_lens), Hq, d, generator=gen)
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    tables = cpu.DecodeTables(cb, layer, enc.prepared(layer))
    for split in (None, 64):
        out[f"decode.split{split}"] = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, tables, cfg, kb, cos,
                                                           sin, d ** -0.5, entry_of, wk, wv, split_tokens=split)
    out["decode.codes_only"] = cpu.decode_attention(q, k_rows, v_rows, indptr, slots, tables, cfg, kb, cos, sin,
                                                    d ** -0.5)


def _hf(out: dict) -> None:
    from transformers import AutoModelForCausalLM

    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.models import resolve_model

    TaSQCache = _mod("sglang_tasq.hf.cache", "sglang_tasq.hf_cache").TaSQCache
    demo = _mod("sglang_tasq.demo")
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.bfloat16).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    ids = tok(demo.haystack(), return_tensors="pt").input_ids[:, :700]
    cache = TaSQCache(load_artifact(ARTIFACT).codebooks, sink=64, recent=256)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -40:].float()
        steps, nxt = [], logits[-1].argmax()
        for _ in range(8):
            lg = model(nxt.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1].float()
            steps.append(lg)
            nxt = lg.argmax()
    out["hf.prefill_logits"] = logits
    out["hf.step_logits"] = torch.stack(steps)


def _engine(meta: dict) -> None:
    worker = next(p for p in (ROOT / "tests" / "integration" / "engine_worker.py", ROOT / "tests" / "engine_worker.py")
                  if p.is_file())
    demo = _mod("sglang_tasq.demo")
    from transformers import AutoTokenizer

    from sglang_tasq.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    texts = [demo.haystack() + "\nWhat is the secret passcode?", "Write a short poem about the sea. " * 30]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for t in texts]

    for name, env in (("numba", {}), ("torch", {"SGLANG_TASQ_CPU_KERNELS": "0"})):
        spec = {"engine": {"model_path": str(resolve_model("smollm2-135m")), "max_running_requests": 4,
                           "mem_fraction_static": 0.05},
                "tasq_config": str(ARTIFACT),
                "tasks": [{"op": "generate", "input_ids": p, "return_logprob": True,
                           "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
                          for p in (prompts if name == "numba" else prompts[:1])]}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps(spec))
            from sglang_tasq.options import child_env

            e = child_env(drop=("SGLANG_TASQ_CONFIG",), **env)
            p = subprocess.run([sys.executable, str(worker), str(path)], capture_output=True, text=True,
                               timeout=900, env=e, cwd=str(ROOT))
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise SystemExit(f"engine ({name}) failed:\n{p.stderr[-3000:]}")
        meta[f"engine.{name}"] = [r["outputs"] for r in json.loads(lines[-1])["results"]]


def record(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {}
    _codec_and_kernels(tensors)
    _hf(tensors)
    _engine(meta)
    save_file({k: v.contiguous() for k, v in tensors.items() if v is not None}, str(d / "golden.safetensors"))
    (d / "golden.json").write_text(json.dumps(meta, indent=1))
    print(f"recorded {len(tensors)} tensors and {len(meta)} engine runs in {d}")


def check(d: Path) -> int:
    want_t = load_file(str(d / "golden.safetensors"))
    want_m = json.loads((d / "golden.json").read_text())
    got_t, got_m = {}, {}
    _codec_and_kernels(got_t)
    _hf(got_t)
    _engine(got_m)
    bad = 0
    for k, w in want_t.items():
        g = got_t.get(k)
        if g is None or g.shape != w.shape or not torch.equal(g.contiguous(), w):
            bad += 1
            diff = (g.float() - w.float()).abs().max().item() if g is not None and g.shape == w.shape else "shape"
            print(f"DIFF {k}: {diff}")
    for k, w in want_m.items():
        if got_m.get(k) != w:
            bad += 1
            print(f"DIFF {k}")
    print(f"{len(want_t)} tensors, {len(want_m)} engine runs: "
          + ("all bit-identical" if not bad else f"{bad} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "check"):
        raise SystemExit(__doc__)
    from sglang_tasq.options import set_env

    # compile every Numba kernel afresh (here and in the engine's processes): a kernel cached in
    # __pycache__ is keyed on its own file only and can hide a change in what it inlines
    set_env("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="golden-numba-"))
    sys.exit(record(Path(sys.argv[2])) if sys.argv[1] == "record" else check(Path(sys.argv[2])))

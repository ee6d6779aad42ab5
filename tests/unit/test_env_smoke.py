"""The environment: SGLang imports on this torch (shims active in every process), and its
MHATokenToKVPool builds on CPU; the embedded model is a supported architecture."""
import subprocess
import sys

import pytest


def test_sglang_imports_and_pool_builds_in_a_fresh_process():
    code = (
        "import torch, sglang\n"
        "from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool\n"
        "p = MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=3, head_dim=64,\n"
        "                     layer_num=2, device='cpu', enable_memory_saver=False)\n"
        "k = p.get_key_buffer(0)\n"
        "print(sglang.__version__, tuple(k.shape), k.dtype)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    version, shape = r.stdout.split()[0], r.stdout.split("(")[1]
    assert version == "0.5.23"
    assert shape.startswith("65, 3, 64")


def test_shims_act_only_without_cuda():
    import torch

    from sglang_tasq.srt import _compat_shims

    assert _compat_shims._no_cuda() == (not torch.cuda.is_available())


def test_unsupported_model_is_refused_with_a_clear_error():
    from sglang_tasq.models import UnsupportedModelError, check_supported

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        check_supported({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        check_supported({"architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert check_supported({"architectures": ["Qwen3ForCausalLM"]}) == "Qwen3ForCausalLM"


def test_default_model_fingerprint(smollm2_dir):
    from sglang_tasq.models import fingerprint, load_config

    fp = fingerprint(load_config(smollm2_dir))
    assert (fp.num_layers, fp.num_q_heads, fp.num_kv_heads, fp.head_dim) == (30, 9, 3, 64)
    assert fp.rope_theta == 100000.0 and fp.rope_scaling is None

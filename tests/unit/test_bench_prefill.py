"""bench.prefill's prompts are fixed per length and free of special tokens (the timing itself
is a benchmark run, not a test)."""
from bench import prefill


def test_prompt_ids_are_fixed_per_length_and_skip_special_tokens():
    a, b = prefill.prompt_ids(300), prefill.prompt_ids(300)
    assert a == b and len(a) == 300
    assert min(a) >= 100 and max(a) < 49152
    assert prefill.prompt_ids(301)[:300] != a  # each length its own prompt (no shared radix prefix)


def test_servers_run_without_the_radix_cache():
    """Every rep must prefill its whole prompt: a radix hit would time a one-token extend."""
    from pathlib import Path
    from types import SimpleNamespace

    from bench import serving

    opts = prefill.server_opts(SimpleNamespace(mem_fraction_static=0.05, tasq_config=Path("a/tasq.json")))
    for name in ("bf16", "tasq"):
        cmd = serving.server_cmd(name, Path("/m"), 1234, opts, None)
        assert "--disable-radix-cache" in cmd and "--sleep-on-idle" in cmd

"""``python -m bench.quality``: the KV-cache quality suite (config in, files out, resumable).

    python -m bench.quality --quick                      # CI smoke: bf16/CQ/TaSQ, fast artifacts
    python -m bench.quality                              # everything on SmolLM2-135M (hours on CPU)
    python -m bench.quality --methods bf16,tasq --benches perplexity --artifact tasq=artifacts/smollm2

Every method (``bench.methods``) is run with windows "none" and "64+256" through
perplexity (+ next-token KL, top-1, per-layer attention error), RULER NIAH, error by
position beyond the calibration length, and a CQ/TaSQ rate sweep. Results go to
``bench/results/quality/<config name>/``: ``config.json``, ``items/`` (one JSON per finished
unit of work, skipped when present), ``work/`` (bf16 reference log-probs, not committed),
``metrics.json`` (with ``separates``: :mod:`bench.separation`'s verdicts, and ``paired_vs_tasq``:
every method's per-window difference from TaSQ with its paired interval), ``summary.json``
(rows; NIAH per length and task as mean, 95% bootstrap interval and n in ``niah_ci``) /
``summary.md``, PNG plots. The headline copy is
``bench/results/quality/summary.json`` (+ ``summary.md``); a quick run does not replace a
full run's headline, and a run without the perplexity bench (a rate sweep or error-by-position
run alone) leaves it as it is.
"""
from __future__ import annotations

from sglang_tasq.options import passive_omp  # noqa: E402

passive_omp()  # before torch starts OpenMP: no spinning on shared cores

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

from . import methods as M  # noqa: E402
from . import niah, perplexity, positions, rate_sweep, report, ruler, ruler_server, separation  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "quality"
BENCHES = ("perplexity", "ruler", "positions", "rate_sweep")


@dataclass(frozen=True)
class QualityConfig:
    """Everything that decides the numbers. ``name()`` is the results folder."""

    model: str = "smollm2-135m"
    preset: str = "default"  # calibration preset of the artifacts made on demand
    methods: tuple = M.METHODS
    benches: tuple = BENCHES
    ppl_len: int = 2048
    ppl_windows: int = 16
    ood_windows: int = 8
    kl_stride: int = 32
    niah_lengths: tuple = (1024, 2048, 4096, 8192)
    niah_samples: int = 8  # per task: enough for a 95% interval (bench.stats)
    niah_max_new: Optional[int] = None  # generated-token cap (None: RULER's 128)
    niah_tasks: tuple = tuple(niah.TASKS)
    niah_view: str = "decode"  # "decode": HF model under the window rule; "server": real SGLang servers
    niah_question: str = "last"  # where the prompt asks: "last" (RULER) or "first" (before the haystack)
    niah_methods: tuple = ("bf16", "fp8_e4m3", "kivi2", "cq", "tasq", "tasq_keys_only", "tasq_values_only")
    pos_len: int = 8192
    pos_windows: int = 2
    pos_stride: int = 16
    pos_methods: tuple = ("bf16", "fp8_e4m3", "kivi2", "cq", "tasq")
    sweep_methods: tuple = ("cq", "tasq")
    sweep_points: tuple = rate_sweep.DEFAULT_POINTS
    sweep_windows: int = 8
    artifacts: tuple = ()  # ((artifact_name, path), ...) overrides
    artifact_root: str = "artifacts/quality"
    quick: bool = False

    def __post_init__(self):
        for m in self.methods:
            M.parse(m)
        bad = set(self.benches) - set(BENCHES)
        if bad:
            raise ValueError(f"benches {sorted(bad)}: allowed {BENCHES}")
        if self.niah_view not in ruler.VIEWS:
            raise ValueError(f"niah_view {self.niah_view!r}: allowed {ruler.VIEWS}")
        if self.niah_question not in ("last", "first"):
            raise ValueError(f"niah_question {self.niah_question!r}: allowed 'last', 'first'")
        if self.niah_view == "server" and "ruler" in self.benches:
            ruler_server.check_servable(ruler.niah_names(self.methods, self.niah_methods))
        if self.preset not in ("default", "fast"):
            raise ValueError(f"preset {self.preset!r}: allowed 'default', 'fast'")

    def name(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("artifacts"), d.pop("artifact_root")  # where artifacts live does not change results
        if self.niah_question == "last":  # RULER's order (absent: earlier names stay valid)
            d.pop("niah_question")
        if self.niah_view == "server":  # the servers' settings (absent otherwise: earlier names stay valid)
            d["niah_server"] = ruler_server.SERVER_KEY
        from sglang_tasq.models import compute_dtype, dtype_name

        dtype = dtype_name(compute_dtype())
        if dtype != "bfloat16":  # a float32-model run (a CPU without bf16 matmuls) is its own run
            d["model_dtype"] = dtype
        h = hashlib.sha1(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:8]
        tag = "quick" if self.quick else "full"
        return f"{self.model}_{tag}_{self.preset}_{h}"


QUICK = dict(preset="fast", methods=("bf16", "cq", "tasq"), benches=("perplexity", "ruler"), ppl_windows=1,
             ood_windows=1, niah_lengths=(1024,), niah_samples=1, niah_max_new=64, niah_methods=("bf16", "tasq"),
             quick=True)


@dataclass
class Context:
    """What the benchmark modules share: model, tokenizer, built methods, bits, run folder."""

    cfg: QualityConfig
    model: object
    tok: object
    methods: dict  # name -> KVMethod (main comparison)
    sweep: dict  # name -> KVMethod (rate points)
    bits: dict  # name -> (bits_k, bits_v)
    run_dir: Path
    log: Callable = field(default=print)
    artifact_ids: dict = field(default_factory=dict)  # artifact name -> sha256 of its tensors file


def build_context(cfg: QualityConfig, run_dir: Path, log=print, model=None, tok=None) -> Context:
    from sglang_tasq.models import fingerprint, load_config, resolve_model, rope_inv_freq

    if model is None:
        model, tok = perplexity.load_model(cfg.model)
    limit = model.config.max_position_embeddings
    if cfg.ppl_len > limit and {"perplexity", "rate_sweep"} & set(cfg.benches):
        raise ValueError(f"ppl_len {cfg.ppl_len}: model {cfg.model} has {limit} positions")
    H = model.config.num_key_value_heads
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    overrides = dict(cfg.artifacts)
    sweep_names = rate_sweep.names(cfg.sweep_methods, cfg.sweep_points) if "rate_sweep" in cfg.benches else []
    calibrated = any(isinstance(s, M.MixSpec) or s.calib for s in map(M.parse, [*cfg.methods, *sweep_names]))
    fp = fingerprint(load_config(resolve_model(cfg.model))) if calibrated else None
    built, bits, ids = {}, {}, {}
    for name in dict.fromkeys([*cfg.methods, *sweep_names]):
        spec = M.parse(name)
        if isinstance(spec, M.MixSpec):  # a layer mix: its two artifacts, or its one mixed artifact
            built[name], arts = M.prepare(spec, cfg.model, cfg.preset, Path(cfg.artifact_root), overrides, fp, log)
            bits[name] = M.bits(built[name], H, d)
            ids.update({n: M.artifact_sha(a) for n, a in arts.items()})
            continue
        art = M.ensure_artifact(spec, cfg.model, cfg.preset, Path(cfg.artifact_root), overrides, log)
        rope = rope_inv_freq(model) if spec.closed_form in M.NSN_METHODS else None  # NSNQuant's keys
        built[name] = M.build(spec, art, fp, rope=rope)
        bits[name] = M.bits(built[name], H, d)
        if art is not None:
            ids[spec.artifact_name] = M.artifact_sha(art)
    return Context(cfg, model, tok, {m: built[m] for m in cfg.methods}, {m: built[m] for m in sweep_names},
                   bits, run_dir, log, ids)


def check_artifacts(run_dir: Path, ids: dict) -> None:
    """Results are resumed only with the artifacts they were computed with (recorded in
    ``artifacts.json``): a recalibrated artifact would otherwise mix old and new items."""
    path = run_dir / "artifacts.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    stale = {k: (M.short_id(old[k]), M.short_id(v)) for k, v in ids.items() if k in old and old[k] != v}
    if stale:
        raise ValueError(f"results in {run_dir} were computed with other artifacts (name: (then, now) artifact id: "
                         f"tensors sha256 [+ serving settings]) {stale}; pass --results DIR for a new run, or "
                         "delete the folder")
    report.write_json(path, {**old, **ids})


def run(cfg: QualityConfig, results: Path = RESULTS, log=print, model=None, tok=None) -> dict:
    """Run (or resume) the suite; returns the metrics dict also written to metrics.json."""
    run_dir = Path(results) / cfg.name()
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ctx = build_context(cfg, run_dir, log, model, tok)
    check_artifacts(run_dir, ctx.artifact_ids)  # before anything is written: a refused run changes nothing
    report.write_json(run_dir / "config.json", dataclasses.asdict(cfg))
    ppl = perplexity.run(ctx) if "perplexity" in cfg.benches else {}
    nia = ruler.run(ctx) if "ruler" in cfg.benches else {}
    pos = positions.run(ctx) if "positions" in cfg.benches else {}
    sweep = rate_sweep.run(ctx) if "rate_sweep" in cfg.benches else []
    rows = report.summary_rows(cfg.methods, ctx.bits, ppl, nia)
    tg = report.targets(rows)
    sep = separation.verdicts(ppl.get("wiki", {}), sweep, rows)
    paired = separation.against(ppl.get("wiki", {}))
    import platform

    import torch

    from sglang_tasq.models import compute_dtype, dtype_name

    env = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "device": "cpu", "dtype": f"{dtype_name(compute_dtype())} model, fp32 attention"}
    header = (f"# KV quality: {cfg.model}, run {cfg.name()}\n\nWindows 'none' read every token from codes; '64+256' keeps "
              f"64 sink + 256 recent tokens exact per query (decode view). PPL on {cfg.ppl_windows} x {cfg.ppl_len} "
              f"held-out wiki tokens and {cfg.ood_windows} x {cfg.ppl_len} held-out stdlib code; NIAH: "
              f"{cfg.niah_samples} sample(s) per task and length, {cfg.niah_view} view"
              f"{', question asked first (before the haystack)' if cfg.niah_question == 'first' else ''}. Artifacts: preset '{cfg.preset}'. "
              f"Hardware: {env['cpu']}, {env['threads']} threads, torch {env['torch']}.")
    if cfg.niah_view == "server" and "ruler" in cfg.benches:
        header += ("\n\nNIAH server view: real SGLang servers (CPU, radix cache on, chunked prefill "
                   f"{ruler_server.CHUNK}, {ruler_server.CONCURRENCY} requests in flight), each sample sent twice (cold, "
                   "then warm from the radix cache). TaSQ is served with its artifact's windows only: the 'none' "
                   "setting cannot be served and is not measured.")
    plain_ruler = {m: {s: {k: {kk: vv for kk, vv in r.items() if kk != "preds"} for k, r in by_l.items()}
                       for s, by_l in by_s.items()} for m, by_s in nia.items()}
    metrics = {"config": dataclasses.asdict(cfg), "env": env, "summary": rows, "targets": tg, "separates": sep,
               "paired_vs_tasq": paired,
               "perplexity": ppl, "ruler": plain_ruler, "positions": pos, "rate_sweep": sweep,
               "wall_s": round(time.time() - t0, 1)}
    bf = next((r["ppl_wiki"] for r in rows if r["method"] == "bf16"), None)
    metrics["plots"] = report.plots(run_dir, ppl, plain_ruler, pos, sweep, bf)
    report.write_json(run_dir / "metrics.json", metrics)
    md = report.markdown(rows, tg, plain_ruler, sweep, header, sep, paired)
    report.write_json(run_dir / "summary.json", rows)
    (run_dir / "summary.md").write_text(md)
    _headline(cfg, run_dir, rows, md)
    return metrics


def replaces_headline(cfg: QualityConfig, prev) -> bool:
    """Whether a run of ``cfg`` becomes the headline (``summary.json`` rows ``prev`` or None):
    only runs that measure perplexity (the headline's columns), and a quick run never
    replaces a full run's headline."""
    if "perplexity" not in cfg.benches:
        return False
    full_before = isinstance(prev, list) and bool(prev) and not prev[0].get("quick", True)
    return not (cfg.quick and full_before)


def _headline(cfg: QualityConfig, run_dir: Path, rows: list, md: str) -> None:
    top = run_dir.parent / "summary.json"
    if not replaces_headline(cfg, json.loads(top.read_text()) if top.is_file() else None):
        return
    report.write_json(top, [{**r, "run": run_dir.name, "quick": cfg.quick} for r in rows])
    shutil.copyfile(run_dir / "summary.md", run_dir.parent / "summary.md")


def _tuple(s: str, conv=str) -> tuple:
    return tuple(conv(x) for x in s.split(",") if x)


def parse_args(argv=None) -> tuple[QualityConfig, Path]:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", 
                    help="CI preset: bf16/cq/tasq, fast artifacts, 1+1 PPL windows; NIAH (bf16, tasq) 1k x 1 sample per task, <= 64 new tokens")
    ap.add_argument("--model")
    ap.add_argument("--preset", choices=("default", "fast"))
    ap.add_argument("--methods", help=f"comma list of {M.METHODS} or rate points like tasq@g8k256")
    ap.add_argument("--benches", help=f"comma list of {BENCHES}")
    ap.add_argument("--ppl-len", type=int,
                    help="tokens per perplexity and rate-sweep window (default 2048; SmolLM2 allows up to 8192)")
    ap.add_argument("--ppl-windows", type=int)
    ap.add_argument("--ood-windows", type=int)
    ap.add_argument("--niah-lengths", help="comma list, e.g. 1024,2048")
    ap.add_argument("--niah-samples", type=int)
    ap.add_argument("--niah-tasks", help="comma list of tasks (default all 8)")
    ap.add_argument("--niah-methods", help="comma list; empty string = all methods")
    ap.add_argument("--niah-view", choices=ruler.VIEWS,
                    help="decode (default): the HF model under the server's window rule; server: real SGLang servers "
                         "(chunked prefill, radix cache on, each sample twice; bf16 and plain tasq only)")
    ap.add_argument("--niah-question", choices=("last", "first"),
                    help="where the prompt asks (default last, RULER's; first: before the haystack, where a "
                         "salient selection at the prompt's end cannot see it)")
    ap.add_argument("--pos-windows", type=int)
    ap.add_argument("--pos-len", type=int, help="tokens per error-by-position window (default 8192)")
    ap.add_argument("--pos-methods", help="comma list for the error-by-position bench; empty string = all methods")
    ap.add_argument("--sweep-windows", type=int)
    ap.add_argument("--artifact", action="append", default=[], 
                    help="NAME=DIR: use this artifact (e.g. tasq=artifacts/smollm2)")
    ap.add_argument("--artifact-root")
    ap.add_argument("--results", default=str(RESULTS))
    a = ap.parse_args(argv)
    kw = dict(QUICK) if a.quick else {}
    simple = {"model": a.model, "preset": a.preset, "ppl_len": a.ppl_len, "ppl_windows": a.ppl_windows,
              "ood_windows": a.ood_windows, "niah_samples": a.niah_samples, "niah_view": a.niah_view,
              "niah_question": a.niah_question,
              "pos_windows": a.pos_windows, "pos_len": a.pos_len, "sweep_windows": a.sweep_windows,
              "artifact_root": a.artifact_root}
    kw.update({k: v for k, v in simple.items() if v is not None})
    for key, val, conv in (("methods", a.methods, str), ("benches", a.benches, str), ("niah_lengths", a.niah_lengths, int),
                           ("niah_tasks", a.niah_tasks, str), ("niah_methods", a.niah_methods, str),
                           ("pos_methods", a.pos_methods, str)):
        if val is not None:
            kw[key] = M.split_names(val) if key.endswith("methods") else _tuple(val, conv)
    arts = []
    for item in a.artifact:
        if "=" not in item:
            raise SystemExit(f"--artifact {item!r}: expected NAME=DIR")
        arts.append(tuple(item.split("=", 1)))
    kw["artifacts"] = tuple(arts)
    try:
        return QualityConfig(**kw), Path(a.results)
    except ValueError as e:
        raise SystemExit(f"python -m bench.quality: {e}") from None


def main(argv=None) -> int:
    cfg, results = parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[quality] run {cfg.name()} -> {results / cfg.name()}")
    m = run(cfg, results, log)
    print((results / cfg.name() / "summary.md").read_text())
    print(f"wall {m['wall_s']} s; plots: {', '.join(m['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

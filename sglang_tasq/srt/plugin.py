"""SGLang plugin entry point (``sglang.srt.plugins: tasq = sglang_tasq.srt.plugin:load``).

``load()`` runs in every SGLang process (launcher, Engine, schedulers, detokenizer). It:

- registers the attention backend ``tasq`` (registry + ``--attention-backend`` choices);
- adds ``--tasq-config PATH`` to SGLang's parser (``--help``) and, around
  ``prepare_server_args``, strips it, exports the path as ``SGLANG_TASQ_CONFIG`` (inherited by
  the spawned processes), selects the ``tasq`` backend, and validates everything
  (:mod:`sglang_tasq.srt.launch`) before any weights load: a refusal is one stderr line, exit 2;
- before ``ServerArgs.resolve_once`` (every launcher, ``sglang.Engine`` included) runs the same
  validation (raising :class:`launch.TaSQLaunchError`) and selects the backend if unset;
- returns :class:`pool.TaSQTokenToKVPool` from the platform's ``get_kv_pool_cls(kind="mha")``,
  bound to the artifact slice of this scheduler's tensor-parallel rank (its KV heads and their
  codebooks, :func:`launch.rank_artifact`); each data-parallel scheduler builds its own pool;
- reports TaSQ's true bytes per token to ``DefaultPoolConfigurator`` (so
  ``max_total_num_tokens`` grows by the compression ratio, plus each slot's exact-store index)
  and charges the exact window store as fixed overhead, sized from ``--max-running-requests``;
- cuts radix matches where a full-precision window entry is gone and hands recomputed entries
  to the tree's slots on insert (:mod:`sglang_tasq.windows`);
- refuses an empty prompt (zero tokens once tokenized: ``{"text": ""}``, an empty item of a
  batch, ``{"input_ids": [[]]}``; SGLang itself only refuses a flat ``{"input_ids": []}``)
  before ``TokenizerManager._validate_one_request``, with a ``ValueError`` that the HTTP
  server answers with 400. SGLang 0.5.23 otherwise schedules a 0-token prefill, whose
  rotary embedding raises (``cannot reshape tensor of 0 elements``) in the scheduler and
  takes the whole server down. This guard is active with or without ``--tasq-config``.

Without the config (env var unset) every other hook passes straight through.
"""
from __future__ import annotations

import logging

from .. import options, windows
from . import launch

logger = logging.getLogger("sglang_tasq")
_loaded = False


def _register_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if launch.BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([launch.BACKEND_NAME])

    def create_tasq_backend(runner):
        from .backend import TaSQAttnBackend

        return TaSQAttnBackend(runner)

    ATTENTION_BACKENDS[launch.BACKEND_NAME] = create_tasq_backend


# ---- CLI -------------------------------------------------------------------------------------
def _after_add_cli_args(result, parser, *args, **kwargs):
    if any("--tasq-config" in a.option_strings for a in parser._actions):
        return None
    parser.add_argument("--tasq-config", type=str, default=None, metavar="PATH",
                        help="TaSQ artifact (tasq.json from calibration): serve with the ~1.25-bit VQ "
                             "KV cache. Selects --attention-backend tasq.")
    return None


def split_tasq_flag(argv: list) -> tuple[list, str | None]:
    """Remove ``--tasq-config PATH`` / ``--tasq-config=PATH`` from argv; return (argv, path)."""
    out, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--tasq-config":
            if i + 1 >= len(argv):
                launch.refuse(launch.TaSQLaunchError("tasq: --tasq-config needs a PATH"))
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--tasq-config="):
            path, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    return out, path


def _around_prepare_server_args(original, argv, *args, **kwargs):
    argv, path = split_tasq_flag(list(argv))
    if path is not None:
        options.export_config_path(path)
        if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in argv):
            argv += ["--attention-backend", launch.BACKEND_NAME]
    try:
        server_args = original(argv, *args, **kwargs)
        if launch.active():
            launch.validate(server_args)
        return server_args
    except launch.TaSQLaunchError as e:
        launch.refuse(e)


def _before_resolve(server_args, *args, **kwargs):
    if getattr(server_args, "_resolution_finished", False):
        return None
    if not launch.active():
        if getattr(server_args, "attention_backend", None) == launch.BACKEND_NAME:
            raise launch.TaSQLaunchError(f"tasq: --attention-backend tasq needs --tasq-config PATH "
                                         f"(or {launch.ENV_CONFIG})")
        return None
    launch.validate(server_args)
    if getattr(server_args, "attention_backend", None) is None:
        server_args.attention_backend = launch.BACKEND_NAME
    _size_windows(server_args)
    return None


def _size_windows(server_args) -> None:
    """The exact window store holds the windows of every request that can run at once: it is
    sized from ``--max-running-requests``, which is set to ``SGLANG_TASQ_WINDOW_ROWS`` (default
    128) when not given; a limit above an explicit ``SGLANG_TASQ_WINDOW_ROWS`` is refused. The
    server args travel to the spawned processes, where :func:`_served_options` reads the limit."""
    try:
        opts = options.ServeOptions.from_env()
    except options.OptionError as e:
        raise launch.TaSQLaunchError(str(e)) from None
    mrr = getattr(server_args, "max_running_requests", None)
    if mrr is None:
        server_args.max_running_requests = opts.rows()
    elif opts.window_rows is not None and int(mrr) > opts.window_rows:
        raise launch.TaSQLaunchError(
            f"tasq: --max-running-requests {mrr} exceeds SGLANG_TASQ_WINDOW_ROWS={opts.window_rows}, the requests "
            f"whose full-precision windows the store holds; raise SGLANG_TASQ_WINDOW_ROWS or lower the limit")


def _served_options() -> options.ServeOptions:
    """This serving process's options: the environment's, with the exact store sized for the
    resolved ``--max-running-requests`` (set by :func:`_size_windows` in the launcher)."""
    import dataclasses

    from sglang.srt.runtime_context import get_server_args

    opts = options.ServeOptions.from_env()
    sa = get_server_args()
    mrr = getattr(sa, "max_running_requests", None) if sa is not None else None
    chunk = getattr(sa, "chunked_prefill_size", None) if sa is not None else None
    if not chunk or chunk <= 0:
        chunk = getattr(sa, "max_prefill_tokens", None) if sa is not None else None
    return dataclasses.replace(opts, window_rows=int(mrr) if mrr else opts.rows(),
                               forward_tokens=int(chunk) if chunk and chunk > 0 else opts.forward_tokens)


def _around_engine_init(original, self, *args, **kwargs):
    path = kwargs.pop("tasq_config", None)
    if path is not None:
        options.export_config_path(path)
    if launch.active() and "server_args" not in kwargs and kwargs.get("attention_backend") is None:
        kwargs["attention_backend"] = launch.BACKEND_NAME
    return original(self, *args, **kwargs)


# ---- pool --------------------------------------------------------------------------------------
def _rank_artifact():
    """The artifact slice this scheduler's tensor-parallel rank serves (its KV heads only)."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return launch.rank_artifact(int(par.attn_tp_rank), int(par.attn_tp_size))


def _around_get_kv_pool_cls(original, self, *args, kind=None, **kwargs):
    if launch.active() and kind == "mha":
        from .pool import bind

        return bind(_rank_artifact(), _served_options())
    return original(self, *args, kind=kind, **kwargs)


def _around_cell_size(original, self, kvc, num_layers, *args, **kwargs):
    if not launch.active():
        return original(self, kvc, num_layers, *args, **kwargs)
    art = _rank_artifact()
    fp = art.model
    # codes + the slot's exact-store entry index (int64), and with salient tokens their per-slot share
    return windows.cell_bytes(art.config, fp.num_kv_heads, fp.head_dim, int(num_layers))


def _after_pool_configurator_init(result, self, kvc, *args, **kwargs):
    if not launch.active():
        return None
    art = _rank_artifact()
    fp = art.model
    opts = _served_options()
    extra = windows.store_bytes(art.config, fp.num_kv_heads, fp.head_dim, fp.num_layers, opts.rows(),
                                opts.forward_tokens, opts.cached_windows)
    self._fixed_overhead_bytes = int(getattr(self, "_fixed_overhead_bytes", 0) or 0) + extra
    return None


# ---- radix cache -------------------------------------------------------------------------------


def _around_match_prefix(original, self, params, *args, **kwargs):
    """Cut a radix match where the full-precision window entries its first recomputed query
    needs are gone (evicted from the exact store): the rest is recomputed, never read from codes."""
    result = original(self, params, *args, **kwargs)
    P = int(getattr(result, "device_prefix_len", 0) or 0)
    pool = _tasq_pool(self) if P else None
    if pool is None:
        return result
    slots = self.path_device_indices(result.last_device_node)[:P]
    keep = pool.valid_prefix(slots)
    if keep >= P:
        return result
    import dataclasses

    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = params.key
    limit = keep if key.limit is None else min(keep, key.limit)
    cut = RadixKey(key.token_ids, extra_key=key.extra_key, is_bigram=key.is_bigram, limit=limit,
                   cache_salt=key.cache_salt)
    return original(self, dataclasses.replace(params, key=cut), *args, **kwargs)


def _tasq_pool(cache):
    if not launch.active():
        return None
    alloc = getattr(cache, "token_to_kv_pool_allocator", None)
    pool = alloc.get_kvcache() if alloc is not None and hasattr(alloc, "get_kvcache") else None
    return pool if pool is not None and hasattr(pool, "adopt_entries") else None


def _around_insert(original, self, params, *args, **kwargs):
    """A request's freshly computed KV that duplicates tree nodes is freed and the request is
    repointed to the tree's slots: hand the fresh exact entries to those slots where they have
    none (they were evicted, which is why the request recomputed them)."""
    result = original(self, params, *args, **kwargs)
    pool = _tasq_pool(self)
    node = getattr(result, "last_device_node", None)
    fresh = getattr(params, "value", None)
    if pool is None or node is None or fresh is None or not len(fresh):
        return result
    canon = self.path_device_indices(node)
    n = min(len(canon), len(fresh))
    if n:
        pool.adopt_entries(fresh[:n], canon[:n])
    return result


# ---- requests ----------------------------------------------------------------------------------
EMPTY_PROMPT_MESSAGE = ("The input is empty (0 tokens): the prompt must contain at least one token "
                        "(got an empty text, input_ids or input_embeds).")


def _before_validate_one_request(self, obj, input_ids=None, *args, **kwargs):
    """Refuse a request with no input tokens (SGLang would crash the scheduler on it).

    ``TokenizerManager._validate_one_request(obj, input_ids)`` runs for every generate and
    embedding request (single or batched, ``/generate``, ``/v1/*``, ``sglang.Engine``) after
    tokenization and multimodal expansion, so ``input_ids`` is the final prompt; its
    ``ValueError`` becomes HTTP 400 like SGLang's other request checks. Running before the
    original also keeps its decision-layout check from indexing an empty prompt.

    A request that continues a session (``session_params={"id": ...}``) may legitimately send
    no new tokens (the history supplies the prompt); SGLang's session controller aborts it
    cleanly if it is still empty after restoring the history, so it is let through."""
    if "input_ids" in kwargs:
        input_ids = kwargs["input_ids"]
    sp = getattr(obj, "session_params", None)
    if (sp.get("id") if isinstance(sp, dict) else getattr(sp, "id", None)) is not None:
        return None
    embeds = getattr(obj, "input_embeds", None)
    # None means "no token list at this point" (SGLang tolerates it), not an empty prompt.
    seq = embeds if embeds is not None else input_ids
    if seq is not None and len(seq) == 0:
        raise ValueError(EMPTY_PROMPT_MESSAGE)
    return None


def load() -> None:
    """Plugin entry point: register the backend, the flag and the (pass-through) hooks."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _register_backend()
    reg = HookRegistry.register
    reg("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    reg("sglang.srt.server_args.prepare_server_args", _around_prepare_server_args, HookType.AROUND)
    reg("sglang.srt.server_args.ServerArgs.resolve_once", _before_resolve, HookType.BEFORE)
    reg("sglang.srt.entrypoints.engine.Engine.__init__", _around_engine_init, HookType.AROUND)
    reg("sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls", _around_get_kv_pool_cls, HookType.AROUND)
    reg("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        _around_cell_size, HookType.AROUND)
    reg("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
        _after_pool_configurator_init, HookType.AFTER)
    for cls in ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache",
                "sglang.srt.mem_cache.radix_cache.RadixCache"):
        reg(f"{cls}.match_prefix", _around_match_prefix, HookType.AROUND)
        reg(f"{cls}.insert", _around_insert, HookType.AROUND)
    reg("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        _before_validate_one_request, HookType.BEFORE)

"""Loading the model: the bundle, the KV rows its memory budget allows (`kv_sizing`), the engine's settings
from the server's (`engine_settings`, `session_config`, `scheduler_limits`, `request_limits`), the engine
process's CPUs and this process's (`checked_engine_cpus`, `place_server`), then the warmed-up engine and its
started scheduler (`load_model`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from serve.api.common import LoadedModel
from serve.api.config import ConfigError, ServerSettings
from serve.api.metrics import Metrics
from serve.api.sizing import DraftCost, KvSizing, ServedFeatures, kv_itemsize, pod_memory, size_kv_cache
from serve.api.validation import RequestLimits
from serve.bundle import Bundle, Manifest, load_bundle, read_manifest, serving_weight_bytes
from serve.engine.types import (
    EngineInfo,
    EngineSettings,
    SessionConfig,
    SpeculationSettings,
    default_compiled_cache,
)
from serve.errors import BundleError
from serve.process import (
    allowed_cpus,
    beside,
    check_cpus,
    engine_cpus,
    format_cpu_list,
    pin_process,
)
from serve.scheduling.engine_client import EngineProcess, ProcessScheduler
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.messages import EngineSpec, EngineWrap
from serve.scheduling.scheduler import open_in_thread, prepare_graph

log = logging.getLogger("textgen.server")


def request_limits(settings: ServerSettings, info: EngineInfo, max_total_tokens: int) -> RequestLimits:
    # A KV slot, or the whole batch budget when that is smaller, bounds prompt + new tokens.
    context = max_total_tokens
    return RequestLimits(
        vocab_size=info.vocab_size,
        context_length=context,
        max_prompt_tokens=min(settings.max_prompt_tokens or context - 1, context - 1),
        default_max_new_tokens=settings.default_max_new_tokens,
        max_new_tokens=settings.max_new_tokens,
        max_stop_strings=settings.max_stop_strings,
        max_stop_length=settings.max_stop_length,
        prompt_logprobs=settings.prompt_logprobs,
    )


def scheduler_limits(settings: ServerSettings, sizing: KvSizing | None = None) -> SchedulerLimits:
    return SchedulerLimits.of(settings, sizing.max_batch_size if sizing else settings.max_batch_size)


def session_config(settings: ServerSettings) -> SessionConfig:
    """The engine's ONNX Runtime session as the flags ask for it."""
    threads = settings.threads or len(engine_cpus(settings.engine_cpus) or ())  # 0: ONNX Runtime's choice
    return SessionConfig(
        providers=tuple(settings.providers or ()),
        threads=threads,
        spinning=settings.spinning,
        spin_between_runs=settings.spin_between_steps,
    )


def engine_settings(settings: ServerSettings, sizing: KvSizing | None = None) -> EngineSettings:
    """The engine's settings; `sizing` (the KV rows the memory budget allows) over the flags' own rows."""
    return EngineSettings(
        max_batch_size=sizing.max_batch_size if sizing else settings.max_batch_size,
        capacity=sizing.max_model_len if sizing else settings.max_model_len,
        session=session_config(settings),
        prefix_cache_rows=sizing.prefix_cache_rows if sizing else settings.prefix_cache_rows,
        prefix_cache_min_tokens=settings.prefix_cache_min_tokens,
        speculation=speculation_settings(settings),
        adapters=tuple((name, str(folder)) for name, folder in settings.lora),
        max_cpu_loras=settings.max_cpu_loras,
        kv_cache_dtype=settings.kv_cache_dtype,
        compiled_cache=compiled_cache(settings),
    )


def compiled_cache(settings: ServerSettings) -> Path | None:
    """Where the engine keeps its prepared graph; None: it builds its sessions from the bundle's graph."""
    if not settings.prepared_graph:
        return None
    return settings.compiled_cache or default_compiled_cache()


def speculation_settings(settings: ServerSettings) -> SpeculationSettings:
    return SpeculationSettings(
        num_tokens=settings.num_speculative_tokens if settings.speculative != "off" else 0,
        ngram_min=settings.prompt_lookup_min,
        ngram_max=settings.prompt_lookup_max,
        draft_bundle=None if settings.draft_bundle is None else str(settings.draft_bundle),
    )


def draft_cost(settings: ServerSettings) -> DraftCost | None:
    """What --speculative draft's model takes from the KV budget; None without one."""
    if settings.speculative != "draft" or settings.draft_bundle is None:
        return None
    root = Path(settings.draft_bundle)
    manifest = read_manifest(root)  # the engine loads and checks the draft bundle whole later
    per_token = manifest.architecture.kv_bytes_per_token(kv_itemsize(manifest))  # its cache: as exported
    return DraftCost(serving_weight_bytes(root, manifest), per_token)


def served_names(settings: ServerSettings, bundle: Bundle) -> tuple[str, ...]:
    """The names a request's `model` gives the base model by: --served-model-name, or the bundle's."""
    return tuple(settings.served_model_name or (bundle.manifest.model_name,))


def check_adapter_names(settings: ServerSettings, bundle: Bundle) -> None:
    """BundleError for an adapter named as the model: a request's `model` could not tell them apart."""
    names = served_names(settings, bundle)
    for name, _ in settings.lora:
        if name in names:
            raise BundleError(
                f"adapter {name!r} has a name the model is served by ({', '.join(names)}): name it "
                "otherwise in --lora"
            )


def kv_rows(settings: ServerSettings, manifest: Manifest) -> KvSizing:
    """The KV rows the settings allocate for a bundle of this manifest (ConfigError: none fits the budget)."""
    return size_kv_cache(
        manifest,
        settings.max_model_len,
        settings.kv_cache_memory,
        settings.max_batch_size,
        settings.prefix_cache_rows,
        draft_cost(settings),
        settings.kv_cache_dtype,
    )


def served_features(settings: ServerSettings) -> ServedFeatures:
    """What the flags make a server hold beside its weights and KV rows, for the pod memory formula."""
    return ServedFeatures(
        speculative=settings.speculative != "off",
        prompt_logprobs=settings.prompt_logprobs,
        # Without runtime loads only the adapters given at start are ever held.
        registered_adapters=settings.max_cpu_loras if settings.lora_runtime_updates else len(settings.lora),
        swap_bytes=settings.swap_space if settings.scheduling_policy == "priority" else 0,
        prepared_graph=settings.prepared_graph,
    )


def pod_memory_report(settings: ServerSettings) -> str:
    """The memory a pod serving these settings needs, with the arithmetic (--print-pod-memory)."""
    root = Path(settings.bundle)
    manifest = read_manifest(root)
    sizing = kv_rows(settings, manifest)
    pod = pod_memory(root, manifest, sizing, served_features(settings))
    arch, itemsize = manifest.architecture, kv_itemsize(manifest, settings.kv_cache_dtype)
    per_token = (
        f"a token: 2 (K, V) x {arch.n_layers} layers x {arch.n_kv_heads} KV heads x {arch.head_dim} "
        f"head dim x {itemsize} bytes = {arch.kv_bytes_per_token(itemsize)} bytes"
    )
    model = f"{root} ({manifest.model_name}, quantization {manifest.quantization})"
    return "\n".join([model, f"{sizing.describe()}; {per_token}", pod.describe()])


def prepare_serving_graph(settings: ServerSettings) -> str:
    """--prepare-only: the serving graph these settings serve, prepared in the compiled cache unless a usable
    entry is there; one line saying where. BundleError when it cannot be prepared."""
    cache = compiled_cache(settings)
    assert cache is not None, "the settings refuse --prepare-only with --no-prepared-graph"
    entry = prepare_graph(load_bundle(settings.bundle), engine_settings(settings))
    return f"{settings.bundle}: prepared graph {entry} (served from --compiled-cache {cache})"


def kv_sizing(settings: ServerSettings, manifest: Manifest) -> KvSizing:
    """The KV rows to allocate for a bundle of this manifest (ConfigError: none fits the budget), logged."""
    sizing = kv_rows(settings, manifest)
    log.info("%s", sizing.describe())
    if sizing.max_batch_size < settings.max_batch_size:
        log.warning(
            "max_batch_size %d -> %d: kv_cache_memory holds %d rows of %d tokens",
            settings.max_batch_size,
            sizing.max_batch_size,
            sizing.max_batch_size,
            sizing.max_model_len,
        )
    return sizing


def checked_engine_cpus(settings: ServerSettings) -> frozenset[int] | None:
    """The engine process's CPUs (`engine_cpus` resolved); ConfigError for CPUs this process may not use."""
    cpus = engine_cpus(settings.engine_cpus)
    if cpus is None and settings.engine_cpus == "auto":
        log.warning("engine_cpus auto: this process may run on one CPU only; nothing to keep apart")
    elif cpus is not None:
        try:
            check_cpus(cpus, "engine_cpus")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if settings.threads is not None and settings.threads > len(cpus):
            log.warning(
                "threads %d on %d engine CPUs: ONNX Runtime's threads will take turns (leave threads unset)",
                settings.threads,
                len(cpus),
            )
    return cpus


def place_server(engine_cpus: frozenset[int]) -> None:
    """Move this process off the engine process's CPUs onto the rest of those it may use (none left: stay)."""
    rest = beside(engine_cpus)
    if rest is not None:
        pin_process(frozenset(rest))
    log.info(
        "engine process on CPUs %s; the server's process on %s",
        format_cpu_list(engine_cpus),
        format_cpu_list(rest or allowed_cpus()),
    )


async def load_model(
    settings: ServerSettings,
    metrics: Metrics | None,
    wrap: EngineWrap | None = None,
    process: EngineProcess | None = None,
) -> LoadedModel:
    """Bundle, warmed-up engine (in its own process, or here), started scheduler; raises BundleError for a
    bundle that cannot be served. `wrap` wraps the engine before the scheduler gets it (tests); `process`:
    the engine process, started ahead (None: started here)."""
    root = Path(settings.bundle)
    sizing = kv_sizing(settings, read_manifest(root))  # the engine loads the bundle itself
    cpus = checked_engine_cpus(settings) if settings.engine_process else None
    limits = scheduler_limits(settings, sizing)
    spec = EngineSpec(root, engine_settings(settings, sizing), limits, settings.log_level, wrap, cpus)
    if not settings.engine_process:
        bundle = await _front_end_bundle(settings)
        scheduler = await open_in_thread(spec, metrics)
        checks = request_limits(settings, scheduler.info, scheduler.max_total_tokens)
        return LoadedModel(bundle, scheduler, checks, served_names=served_names(settings, bundle))
    engine = ProcessScheduler(spec, metrics, process)
    starting = asyncio.create_task(engine.start())
    try:
        bundle = await _front_end_bundle(settings)  # while the engine process builds the engine
        await starting
    finally:
        if not starting.done():  # this side failed first: the engine process goes too
            starting.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):  # the first failure is the one raised
            await starting
    if cpus is not None:
        place_server(cpus)
    checks = request_limits(settings, engine.info, engine.max_total_tokens)
    return LoadedModel(bundle, engine, checks, served_names=served_names(settings, bundle))


async def _front_end_bundle(settings: ServerSettings) -> Bundle:
    """The bundle as the front end needs it (the tokenizer, the manifest; no graph is opened here)."""
    bundle = await asyncio.to_thread(load_bundle, settings.bundle)
    check_adapter_names(settings, bundle)
    return bundle

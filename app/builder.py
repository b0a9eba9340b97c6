"""The `serve run` entry point: `app.builder:build_app`, configured by serve_config.yaml's `args`.

Serve validates `args` against `AppArgs` because the builder's parameter is annotated with it; that
needs real (not stringified) annotations, so this module must not use `from __future__ import
annotations`. Engine options are EngineConfig.from_kwargs keywords (block_size, max_num_seqs,
max_waiting, gpu_memory_utilization, num_blocks, max_model_len, dtype, ...) and are checked here, in
the driver, so a typo fails `serve run` at once instead of crash-looping a replica.
"""

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from app.engine_deployment import EngineDeployment
from app.ingress import Ingress
from app.lora_modules import parse_lora_modules
from app.security import DEFAULT_MAX_BODY_BYTES
from app.tool_calls import resolve_parser
from app.tp_placement import check_cluster, engine_resources, start_replicas
from engine.config import EngineConfig

# Serve-level slots on the engine deployment beyond our own admission limit, so that a stream over the
# limit still reaches `generate` (and gets a 503 at once) instead of queueing in the caller, and so that
# /health and /v1/engine/stats calls get through on a full replica.
_CONTROL_HEADROOM = 16
# A leaving ingress replica holds its clients' connections: it must outlive the leaving engine replica's
# drain, so that a stream the engine finishes (or ends with an error event at its deadline) still reaches
# the client. Serve's own budget for an ingress is far shorter and would cut long streams mid-way.
_INGRESS_DRAIN_MARGIN_S = 15.0


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("models/tiny-llama", description="local HF-format checkpoint directory")
    served_model_name: str | None = Field(None, description="API model name; default: directory name")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig.from_kwargs options")
    num_gpus: float | None = Field(
        None,
        description="per engine replica; default 1 if CUDA, else 0. With engine.tensor_parallel_size P > 1: "
        "P (the default with CUDA: one GPU per rank, on one node) or 0 (ranks on CPUs)",
    )
    engine_num_cpus: float = Field(
        1.0, description="per engine replica; with engine.tensor_parallel_size P > 1, per rank"
    )
    num_replicas: int = Field(1, ge=1, description="engine replicas (ignored with autoscaling_config)")
    autoscaling_config: dict[str, Any] | None = Field(None, description="Serve autoscaling for the engine")
    max_ongoing_requests: int = Field(256, ge=1, description="open streams per engine replica; 503 beyond")
    stream_interval_ms: float = Field(
        0.0, ge=0, description="least time between a stream's items after the first"
    )
    stream_items_per_s: float = Field(
        2000.0, gt=0, description="items per second all streams of a replica may yield together (coalescing)"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After header of 503 answers")
    default_max_tokens: int = Field(256, ge=1, description="chat max_tokens when the request sets none")
    stats_interval_s: float = Field(1.0, gt=0, description="engine stats -> metrics gauges period")
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = 0.5
    ingress_max_ongoing_requests: int = Field(
        4096, ge=1, description="Serve's default of 5 would cap streams"
    )
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer <key>' on every route; default: $MINSERVE_API_KEY"
    )
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="larger request bodies get 413")
    reasoning_parser: Literal["think"] | None = Field(
        None,
        description="'think': chat answers put a leading <think>...</think> in reasoning_content "
        "(thinking models); a request's include_reasoning overrides it",
    )
    tool_call_parser: Literal["auto", "llama3_json", "qwen3", "gemma_json", "none"] = Field(
        "auto",
        description="how chat answers' tool calls are found with tool_choice auto: the family's format "
        "(auto: by config.json's model_type), or none (tool_choice auto is then refused)",
    )
    null_core_step_ms: float | None = Field(
        None, gt=0, description="benchmarks only: a core without a model, one token per stream per step"
    )
    prefix_aware_routing: bool | None = Field(
        None,
        description="route each request to the engine replica that holds most of its prefix (app/router.py); "
        "default: on when there can be more than one engine replica",
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="how often each engine replica publishes its prefix-cache summary"
    )
    routing_imbalance_abs: int | None = Field(
        None,
        ge=0,
        description="prefix-aware routing gives way to power of two choices when the holder has more than "
        "this many requests over the least loaded replica (and routing_imbalance_rel times its load); "
        "default 32, or half of autoscaling_config's target_ongoing_requests where that is less",
    )
    routing_imbalance_rel: float = Field(1.5, ge=1.0, description="see routing_imbalance_abs")
    routing_min_gain: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="prefix-aware routing sends a request to the least loaded replica unless another holds "
        "more than this share of its prompt's blocks beyond what that one holds (0: always follow the cache)",
    )
    lora_modules: dict[str, str] | list[str | dict[str, str]] | None = Field(
        None,
        description="LoRA adapters served under their own model names (needs engine.enable_lora): "
        "{name: path}, or vLLM's --lora-modules list of 'name=path' or {name, path}",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); behind api_key when one is set",
    )
    engine_graceful_shutdown_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a leaving engine replica (scale-down, redeploy, shutdown) waits for its "
        "open streams to finish; streams still open then end with an engine_unavailable error event",
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_model_dir(path: str) -> str:
    model = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(
            f"args.model: no checkpoint at {model} (config.json missing). Create the default tiny model "
            "with `make model`, or set `model` in serve_config.yaml to a local HF-format directory."
        )
    return model


def build_app(args: AppArgs) -> Application:
    model = resolve_model_dir(args.model)
    try:
        config = EngineConfig.from_kwargs(model, **args.engine)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"args.engine: {exc}") from exc
    name = args.served_model_name or os.path.basename(model.rstrip("/"))
    lora = _lora(args, config, model, name)
    routing = _routing(args, _max_adapters(config))
    engine = _bind_engine(args, model, name, routing, config.tensor_parallel_size)
    prefix_keys = {"model_dir": model, "block_size": config.cache.block_size} if routing else None
    return _bind_ingress(args, engine, model, name, prefix_keys, lora)


def _lora(args: AppArgs, config: EngineConfig, model: str, name: str) -> dict[str, Any]:
    """The ingress's adapter options (app/lora_admin.py), with lora_modules checked here, in the driver."""
    modules = parse_lora_modules(args.lora_modules, name)
    if modules and not config.enable_lora:
        raise ValueError(
            "args.lora_modules: serving LoRA adapters needs `enable_lora: true` under args.engine "
            "(and max_lora_rank at least the adapters' rank)"
        )
    return {
        "base_root": model,
        "modules": modules,
        "enable_lora": config.enable_lora,
        "allow_runtime_updating": args.allow_runtime_lora_updating,
    }


def _max_adapters(config: EngineConfig) -> int:
    """The adapters one engine replica holds at most (its host cache), 0 without LoRA."""
    return config.lora_host_slots if config.enable_lora else 0


def _bind_engine(args: AppArgs, model: str, name: str, routing: dict[str, Any], tp: int) -> Application:
    """The engine deployment: its replicas' resources (a placement group of `tp` ranks where tp > 1),
    scaling and request router, and its arguments."""
    resources = engine_resources(args.num_gpus, args.engine_num_cpus, tp, _cuda_available)
    check_cluster(resources, tp, start_replicas(args.num_replicas, args.autoscaling_config))
    scaling: dict[str, Any] = (
        {"autoscaling_config": args.autoscaling_config}
        if args.autoscaling_config
        else {"num_replicas": args.num_replicas}
    )
    return EngineDeployment.options(
        **resources,
        max_ongoing_requests=args.max_ongoing_requests + _CONTROL_HEADROOM,
        graceful_shutdown_timeout_s=args.engine_graceful_shutdown_timeout_s,
        **scaling,
        **routing,
    ).bind(
        model=model,
        engine_options=args.engine,
        served_model_name=name,
        max_ongoing_requests=args.max_ongoing_requests,
        stream_interval_ms=args.stream_interval_ms,
        stream_items_per_s=args.stream_items_per_s,
        retry_after_s=args.retry_after_s,
        stats_interval_s=args.stats_interval_s,
        null_core_step_ms=args.null_core_step_ms,
        prefix_summary=bool(routing),  # the core builds the summary only for the router that reads it
    )


def _bind_ingress(
    args: AppArgs,
    engine: Application,
    model: str,
    name: str,
    prefix_keys: dict[str, Any] | None,
    lora: dict[str, Any],
) -> Application:
    """The HTTP ingress in front of `engine`; `prefix_keys` when its requests are routed by prefix."""
    return Ingress.options(
        num_replicas=args.ingress_num_replicas,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=args.engine_graceful_shutdown_timeout_s + _INGRESS_DRAIN_MARGIN_S,
        ray_actor_options={"num_cpus": args.ingress_num_cpus},
    ).bind(
        engine,
        model_name=name,
        default_max_tokens=args.default_max_tokens,
        retry_after_s=args.retry_after_s,
        # read here, in the driver: the replicas may run where this shell's environment is not
        api_key=args.api_key or os.environ.get("MINSERVE_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=resolve_parser(args.tool_call_parser, _model_type(model)),
        prefix_keys=prefix_keys,
        lora=lora,
    )


def _routing(args: AppArgs, max_adapters: int = 0) -> dict[str, Any]:
    """The engine deployment's request router options: prefix-aware (and adapter-aware) where there can
    be several replicas."""
    scaling = args.autoscaling_config
    most = scaling.get("max_replicas", 1) if scaling else args.num_replicas
    if not (args.prefix_aware_routing if args.prefix_aware_routing is not None else most > 1):
        return {}
    from ray.serve.config import RequestRouterConfig

    from app.router import PrefixAwareRouter

    config = RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_routing_stats_period_s=args.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 5 * args.routing_stats_period_s),
        request_router_kwargs={
            "imbalance_abs": _imbalance_abs(args),
            "imbalance_rel": args.routing_imbalance_rel,
            "min_gain": args.routing_min_gain,
            **({"max_adapters": max_adapters} if max_adapters else {}),
        },
    )
    return {"request_router_config": config}


def _imbalance_abs(args: AppArgs) -> int:
    """A replica the autoscaler added must get work before its holders are twice its target: past
    half the target, load wins over cache affinity (Serve's own default target is 2)."""
    if args.routing_imbalance_abs is not None:
        return args.routing_imbalance_abs
    if not args.autoscaling_config:
        return 32
    return max(1, min(32, int(args.autoscaling_config.get("target_ongoing_requests", 2)) // 2))


def _model_type(model: str) -> str | None:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f).get("model_type")

"""Engine configuration: one validated dataclass per component, built once.

Values discovered at run time (the number of KV blocks that fit) live in `KVCacheSpec`
(engine/runner/kv_cache.py), never in these configs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_config import SpeculativeConfig


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = (
        2048  # token budget of one step (decodes first, prefill chunks fill the rest)
    )
    max_num_seqs: int = 256  # running sequences at once
    max_waiting: int = 1024  # queued requests beyond which add_request raises QueueFullError
    max_wait_steps: int = 0  # 0: strict FCFS; otherwise reserved for bounded-wait policies
    # launch the next decode step before the current one's tokens reach the host (engine/llm_engine.py)
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_waiting >= 1, "max_waiting", "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.85  # fraction of total GPU memory the engine may use (weights + KV)
    cpu_kv_cache_bytes: int = 256 * 2**20  # KV budget on CPU
    num_blocks: int | None = None  # override: exactly this many blocks (tests force preemption with it)
    # KV-cache element type. "auto": the model's dtype. "fp8": float8 e4m3 with a unit scale (values
    # clamped to +-448, 3 mantissa bits), half the bytes of bf16: twice the cached tokens, and half the
    # KV traffic of a decode step. Writers clamp and round (kernels/triton_kv.to_cache); attention upcasts
    # exactly as it loads (kernels/triton_attn_common.dot_dtype_for).
    kv_cache_dtype: str = "auto"
    # GiB of host memory for a second KV tier (vLLM's name; docs/kv_offload.md): blocks evicted from the
    # prefix cache are copied there and copied back on a prefix hit instead of recomputed; 0: off.
    # Pinned on a GPU host. Not cpu_kv_cache_bytes, which sizes the pool itself on a CPU engine.
    kv_offloading_size: float = 0.0

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        ok = isinstance(self.kv_offloading_size, int | float) and self.kv_offloading_size >= 0
        _require(ok, "kv_offloading_size", "must be a number of GiB >= 0 (0: no host tier)")
        ok = not self.kv_offloading_size or self.enable_prefix_caching
        _require(ok, "kv_offloading_size", "the host tier keeps prefix-cache blocks: enable_prefix_caching")
        _require(self.kv_cache_dtype in ("auto", "fp8"), "kv_cache_dtype", "must be auto or fp8")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _require(self.cpu_kv_cache_bytes > 0, "cpu_kv_cache_bytes", "must be > 0")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "must be >= 1 or None")


@dataclass(frozen=True)
class ModelLoadConfig:
    model: str  # a local HF-format checkpoint directory
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; or float32 / float16 / bfloat16 / float64
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings, capped at 8192
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs at all: every step launches its kernels
    # CUDA graphs of mixed steps (prefill chunks beside decodes) by token count, besides the decode
    # graphs; False keeps those steps eager (engine/runner/cuda_graph.py)
    mixed_graphs: bool = True
    # cuBLAS front end for GEMMs of more than one row on a GPU (one row takes our Triton GEMV). cuBLASLt
    # picks faster kernels for the 16-256-row decode GEMMs (docs/performance.md); the
    # choice is per process (torch.backends.cuda.preferred_blas_library).
    blas_library: str = "cublaslt"
    # None: weights as the checkpoint stores them (a quantised checkpoint is detected from config.json).
    # "fp8": quantise a float checkpoint's decoder linears at load: per-channel float8 e4m3 weights,
    # dynamic per-token float8 activations (docs/quantization.md).
    quantization: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "give the path of a local checkpoint directory")
        allowed = {"auto", "float32", "float16", "bfloat16", "float64"}
        _require(self.dtype in allowed, "dtype", f"must be one of {sorted(allowed)}")
        _require(
            self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:"),
            "device",
            "must be auto, cpu, cuda or cuda:N",
        )
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _require(self.blas_library in {"cublas", "cublaslt"}, "blas_library", "must be cublas or cublaslt")
        _require(self.quantization in (None, "fp8"), "quantization", "must be None (null) or 'fp8'")


# EngineConfig's own fields among LLM(...)'s flat keywords (the others belong to its parts)
_TOP_LEVEL_OPTIONS = (
    "fault_injection",
    "grammar_process",
    "tensor_parallel_size",
    "disable_custom_all_reduce",
    "tensor_parallel_fp32_reduce",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


@dataclass(frozen=True)
class EngineConfig:
    load: ModelLoadConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    fault_injection: bool = False  # test-only hooks (engine/core/faults.py); never enable in production
    speculative: SpeculativeConfig | None = (
        None  # speculative decoding (engine/spec/speculator.py); None: off
    )
    # structured output's matchers in a process of their own (engine/structured/process.py), so a
    # host-bound loop pays no GIL hand-offs for them; False: on a thread of the engine's process
    grammar_process: bool = True
    # ranks of one engine replica (vLLM's name): the model's heads, MLP and vocabulary are split over
    # this many processes, rank 0 being the engine's own (engine/runner/tp_group.py); 1: no other
    # process. Checked against the model (models/parallel.check_tp) and the GPUs at start-up.
    tensor_parallel_size: int = 1
    # True: every all-reduce of a tensor-parallel forward goes through NCCL; False: small ones take the
    # one-shot all-reduce over NVLink peer-to-peer (engine/models/all_reduce.py). vLLM's name.
    disable_custom_all_reduce: bool = False
    # True: the row-parallel projections hand their partial sums to the all-reduce in fp32, so the sum
    # over ranks is rounded to the model dtype once, as TP=1's GEMM rounds it (engine/models/parallel.py);
    # False: each rank rounds its part first. True moves twice the bytes per all-reduce. Plain 16-bit
    # projections only: quantised and LoRA ones hand over model-dtype partials either way.
    tensor_parallel_fp32_reduce: bool = False
    # multi-LoRA (vLLM's names; docs/lora.md): requests may name a PEFT adapter. max_loras adapters sit
    # in GPU slots at once (a step never needs more), each of rank <= max_lora_rank; max_cpu_loras are
    # kept in host memory, least recently used evicted (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        ok = isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1
        fix = "use a whole number >= 1 (1: no tensor parallelism)"
        _require(ok, "tensor_parallel_size", f"got {tp!r}; {fix}")
        wide = self.tensor_parallel_fp32_reduce
        _require(isinstance(wide, bool), "tensor_parallel_fp32_reduce", f"got {wide!r}; use true or false")
        self._check_lora()

    def _check_lora(self) -> None:
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        _require(whole(self.max_loras) and self.max_loras >= 1, "max_loras", "must be a whole number >= 1")
        ok = whole(self.max_lora_rank) and self.max_lora_rank >= 1
        _require(ok, "max_lora_rank", "must be a whole number >= 1 (16 by default, as vLLM)")
        cpu = self.max_cpu_loras
        ok = cpu is None or (whole(cpu) and cpu >= self.max_loras)
        fix = f"use None or a whole number >= max_loras ({self.max_loras})"
        _require(ok, "max_cpu_loras", f"got {cpu!r}; {fix}")

    @property
    def lora_host_slots(self) -> int:
        """Adapters the host cache holds (max_cpu_loras, or max_loras when unset)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @staticmethod
    def from_kwargs(model: str, **kwargs) -> EngineConfig:
        """Flat keyword form used by LLM(...) and the server: LLM(path, block_size=4, max_num_seqs=8)."""
        parts: dict[type, dict] = {ModelLoadConfig: {}, SchedulerConfig: {}, CacheConfig: {}}
        top = {}
        spec = kwargs.pop("speculative_config", None)  # vLLM's name; a dict or a SpeculativeConfig
        if isinstance(spec, dict):
            spec = SpeculativeConfig.from_dict(spec)
        example = "{'method': 'ngram', 'num_speculative_tokens': 4}"
        ok = spec is None or isinstance(spec, SpeculativeConfig)
        _require(ok, "speculative_config", f"got {type(spec).__name__}; use a dict such as {example}")
        for key, value in kwargs.items():
            for cls, bucket in parts.items():
                if key in cls.__dataclass_fields__:
                    bucket[key] = value
                    break
            else:
                if key in _TOP_LEVEL_OPTIONS:
                    top[key] = value
                else:
                    raise ValueError(f"unknown engine option {key!r}")
        return EngineConfig(
            load=ModelLoadConfig(model=model, **parts[ModelLoadConfig]),
            scheduler=SchedulerConfig(**parts[SchedulerConfig]),
            cache=CacheConfig(**parts[CacheConfig]),
            speculative=spec,
            **top,
        )

"""The gated-LoRA multi-token-prediction head of speculative method gated_lora_mtp: its directory, the
checks at load and the sampler head.

Self-speculation: in a step each real token is followed by k mask tokens m_1..m_k. At a mask position
the model's input is the learned vector `mask_embeddings[i - 1]` (in place of `model.embed`'s output,
so after any family embedding scale) and a LoRA adapter runs in the decoder projections; at real
positions no adapter runs, so the target's outputs there stay the base model's. The sampler head turns
the final hidden state h [N, H] at a mask position (the model forward's output, final norm applied)
and the id p [N] of the token the draft follows into draft logits:

    z = h + fc2(silu(fc1(cat([h, model.embed(p)], -1))))
    logits = model.compute_logits(rms_norm(z, norm.weight, model's rms_norm_eps))   (plain RMSNorm)

The directory (docs/architecture.md, "gated_lora_mtp: the directory"): adapter_config.json and
adapter_model.safetensors (the LoRA in PEFT's layout, read by engine/lora unchanged), mtp_config.json
({"format": FORMAT, "version": 1, "num_mask_tokens": K, "hidden_size": H}, K >= k) and
mtp_head.safetensors (`tensor_shapes`: mask_embeddings [K, H], sampler.fc1.weight [H, 2H],
sampler.fc2.weight [H, H], sampler.norm.weight [H]). Every problem is a ValueError starting
"speculative_config.model: " (a start-up error, as the draft model's) naming the file, the field or
tensor, what was expected and the fix.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import LoRAError
from engine.lora.adapter import FLOAT_DTYPES, AdapterSpec, ModuleShapes, check_adapter
from engine.lora.request import LoRARequest
from engine.lora.weights import AdapterWeights, load_adapter
from kernels import ops

FORMAT = "minserve-gated-lora-mtp"
VERSION = 1
CONFIG_FILE = "mtp_config.json"
HEAD_FILE = "mtp_head.safetensors"
MAX_MTP_LORA_RANK = 256  # LoRA slots are as wide as the largest rank; wider would cost KV pool memory
LORA_NAME = "__gated_lora_mtp__"  # the adapter's name in LoRA slots; no user adapter is named so
_FIX = "write the directory for this target (python -m scripts.make_model --mtp MODEL_DIR DIR)"


class TargetConfig(Protocol):
    """What the head reads of the target's engine.models.config.ModelConfig (ModuleShapes.of: the rest)."""

    hidden_size: int
    rms_norm_eps: float


def tensor_shapes(num_mask_tokens: int, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of mtp_head.safetensors and its shape."""
    k, h = num_mask_tokens, hidden_size
    return {
        "mask_embeddings": (k, h),
        "sampler.fc1.weight": (h, 2 * h),
        "sampler.fc2.weight": (h, h),
        "sampler.norm.weight": (h,),
    }


def _error(where: Path | str, message: str) -> ValueError:
    return ValueError(f"speculative_config.model: {where}: {message}")


class _Weight(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


class MtpHead(nn.Module):
    """The mask embeddings and the sampler head; its state_dict keys are mtp_head.safetensors' names."""

    def __init__(self, num_mask_tokens: int, hidden_size: int, eps: float):
        super().__init__()
        h = hidden_size
        self.eps = eps
        self.mask_embeddings = nn.Parameter(torch.empty(num_mask_tokens, h), requires_grad=False)
        self.sampler = nn.Module()
        self.sampler.fc1, self.sampler.fc2, self.sampler.norm = _Weight(h, 2 * h), _Weight(h, h), _Weight(h)
        self.source: MtpDir | None = None  # the checked directory, once loaded by load_mtp_head

    def mask_embedding(self, index: torch.Tensor) -> torch.Tensor:
        """The input vectors [..., H] of mask positions m_{index + 1} (index: 0-based, < num_mask_tokens)."""
        return F.embedding(index, self.mask_embeddings)

    def draft_logits(
        self,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """hidden [N, H] at mask positions, prev_ids [N] (the token each draft follows) -> logits [N, V];
        embed / compute_logits: the target model's (any family's scale and softcap apply)."""
        e = embed(prev_ids).to(hidden.dtype)
        up = ops.linear(torch.cat([hidden, e], dim=-1), self.sampler.fc1.weight)
        # silu alone has no kernel of its own: elementwise over [N, H], torch's is as fast
        z = hidden + ops.linear(F.silu(up), self.sampler.fc2.weight)
        return compute_logits(ops.rms_norm(z, self.sampler.norm.weight, self.eps))

    def draft(
        self,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The draft tokens [N] int64: argmax of draft_logits (lowest id on ties)."""
        return ops.argmax(self.draft_logits(hidden, prev_ids, embed, compute_logits))


@dataclass(frozen=True)
class MtpDir:
    """A checked MTP directory (only JSON and safetensors headers read)."""

    path: Path
    num_mask_tokens: int  # K: mask tokens the head was trained for (>= num_speculative_tokens)
    hidden_size: int
    adapter: AdapterSpec  # the gated LoRA, checked against the target's projections

    @property
    def lora_rank(self) -> int:
        """The largest rank of the adapter's modules: the LoRA slots must be at least this wide."""
        return max([self.adapter.rank, *(r for _, _, r in self.adapter.modules.values())])

    @property
    def lora_request(self) -> LoRARequest:
        """The adapter as engine/lora's host cache and slots know adapters."""
        return LoRARequest(LORA_NAME, 1, str(self.path))


def read_mtp_config(path: Path, target: TargetConfig, k: int) -> tuple[int, int]:
    """(num_mask_tokens, hidden_size) of mtp_config.json, checked against the target and k."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _error(path, f"no {CONFIG_FILE}; give a gated_lora_mtp directory ({_FIX})")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _error(file, f"is not valid JSON ({exc}); {_FIX}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        got = cfg.get("format") if isinstance(cfg, dict) else cfg
        raise _error(file, f"format is {got!r}, expected {FORMAT!r}; {_FIX}")
    if cfg.get("version") != VERSION:
        raise _error(file, f"version is {cfg.get('version')!r}; this engine reads version {VERSION}; {_FIX}")
    num, hidden = cfg.get("num_mask_tokens"), cfg.get("hidden_size")
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise _error(file, f"num_mask_tokens is {num!r}, expected an integer >= 1; {_FIX}")
    if num < k:
        raise _error(
            file,
            f"num_mask_tokens is {num} but speculative_config.num_speculative_tokens is {k}; lower "
            f"num_speculative_tokens to <= {num} or use a head trained with more mask tokens",
        )
    if hidden != target.hidden_size:
        raise _error(file, f"hidden_size is {hidden!r} but the target's is {target.hidden_size}; {_FIX}")
    return num, hidden


def _check_head_file(path: Path, num_mask_tokens: int, hidden_size: int) -> None:
    """Every tensor of mtp_head.safetensors present, of its shape and a float dtype; nothing else."""
    file = path / HEAD_FILE
    if not file.is_file():
        raise _error(path, f"no {HEAD_FILE}; {_FIX}")
    expected = tensor_shapes(num_mask_tokens, hidden_size)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            found = {
                name: (list(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                for name in f.keys()
            }
    except (OSError, SafetensorError) as exc:
        raise _error(file, f"is not a readable safetensors file ({exc}); {_FIX}") from None
    for name, shape in expected.items():
        if name not in found:
            raise _error(file, f"tensor {name} is missing, expected shape {list(shape)}; {_FIX}")
        got_shape, dtype = found[name]
        if got_shape != list(shape):
            raise _error(file, f"tensor {name} has shape {got_shape}, expected {list(shape)}; {_FIX}")
        if dtype not in FLOAT_DTYPES:
            raise _error(
                file, f"tensor {name} has dtype {dtype}, expected one of {list(FLOAT_DTYPES)}; {_FIX}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise _error(file, f"unexpected tensor(s) {extra}; it holds only {sorted(expected)}; {_FIX}")


def check_mtp_dir(path: str | Path, target: TargetConfig, k: int) -> MtpDir:
    """Check the gated_lora_mtp directory at `path` against the target's config (an
    engine.models.config.ModelConfig) and k = num_speculative_tokens; reads no tensor data."""
    path = Path(path)
    if not path.is_dir():
        raise _error(path, "is not a directory; give the gated_lora_mtp directory")
    num, hidden = read_mtp_config(path, target, k)
    _check_head_file(path, num, hidden)
    try:  # no limit here: a too-large rank gets this module's own fix below
        adapter = check_adapter(path, ModuleShapes.of(target), sys.maxsize)
    except LoRAError as exc:
        raise ValueError(f"speculative_config.model: the gated LoRA: {exc}") from exc
    mtp = MtpDir(path, num, hidden, adapter)
    if mtp.lora_rank > MAX_MTP_LORA_RANK:
        raise _error(
            path / "adapter_config.json",
            f"the gated LoRA has rank {mtp.lora_rank}, above {MAX_MTP_LORA_RANK}; train it with a lower rank",
        )
    return mtp


def load_mtp_head(
    path: str | Path, target: TargetConfig, k: int, dtype: torch.dtype, device: torch.device | str
) -> MtpHead:
    """The checked head in `dtype` on `device`; `head.source` is its MtpDir (the LoRA: load_mtp_lora)."""
    mtp = check_mtp_dir(path, target, k)
    head = MtpHead(mtp.num_mask_tokens, mtp.hidden_size, target.rms_norm_eps)
    file = mtp.path / HEAD_FILE
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise _error(file, f"cannot be read ({exc}); {_FIX}") from None
    head.load_state_dict(tensors, strict=True)
    head.to(dtype=dtype, device=device)
    head.source = mtp
    return head


def load_mtp_lora(mtp: MtpDir, dtype: torch.dtype, pin: bool = False) -> AdapterWeights:
    """The gated LoRA in host memory (scale folded into B), for LoRALinear.load_slot of every LoRA layer
    (`.modules`) or a LoRAManager's host cache (`.request` is mtp.lora_request)."""
    return load_adapter(mtp.lora_request, mtp.adapter, dtype, pin)

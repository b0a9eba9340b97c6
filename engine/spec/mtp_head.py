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

A draft vocabulary (optional): with `draft_token_ids` the head drafts only among those N tokens, the
argmax of the LM head's N rows instead of all V (the vocabulary's most frequent tokens, as FR-Spec
picks them, keep most of the drafts a full argmax would make). A draft is only a proposal, so this
changes acceptance, never output; at batch 1 it cuts the k reads of the LM head per step to N / V.
Under tensor parallelism rank 0 holds a share of the LM head only, and the head drafts over all V.

The directory (docs/architecture.md, "gated_lora_mtp: the directory"): adapter_config.json and
adapter_model.safetensors (the LoRA in PEFT's layout, read by engine/lora unchanged), mtp_config.json
({"format": FORMAT, "version": 1, "num_mask_tokens": K, "hidden_size": H}, K >= k, and optionally
"draft_vocab_size": N) and mtp_head.safetensors (`tensor_shapes`: mask_embeddings [K, H],
sampler.fc1.weight [H, 2H], sampler.fc2.weight [H, H], sampler.norm.weight [H], and with N
draft_token_ids [N], distinct int64 ids of the target's vocabulary). Every problem is a ValueError starting
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
from engine.models.quant_loader import quantize_fp8_rows
from kernels import ops

FORMAT = "minserve-gated-lora-mtp"
VERSION = 1
CONFIG_FILE = "mtp_config.json"
HEAD_FILE = "mtp_head.safetensors"
MAX_MTP_LORA_RANK = 256  # LoRA slots are as wide as the largest rank; wider would cost KV pool memory
LORA_NAME = "__gated_lora_mtp__"  # the adapter's name in LoRA slots; no user adapter is named so
_FIX = "write the directory for this target (python -m scripts.make_model --mtp MODEL_DIR DIR)"


DRAFT_IDS = "draft_token_ids"
ID_DTYPES = ("I64", "I32")


class TargetConfig(Protocol):
    """What the head reads of the target's engine.models.config.ModelConfig (ModuleShapes.of: the rest)."""

    hidden_size: int
    rms_norm_eps: float
    vocab_size: int


def tensor_shapes(
    num_mask_tokens: int, hidden_size: int, draft_vocab_size: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Every tensor of mtp_head.safetensors and its shape."""
    k, h = num_mask_tokens, hidden_size
    shapes = {
        "mask_embeddings": (k, h),
        "sampler.fc1.weight": (h, 2 * h),
        "sampler.fc2.weight": (h, h),
        "sampler.norm.weight": (h,),
    }
    return shapes | ({DRAFT_IDS: (draft_vocab_size,)} if draft_vocab_size else {})


def _error(where: Path | str, message: str) -> ValueError:
    return ValueError(f"speculative_config.model: {where}: {message}")


class _Weight(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


FP8Weight = tuple[torch.Tensor, torch.Tensor]  # (qweight, per-row scales)


def head_linear(
    x: torch.Tensor, weight: torch.Tensor | None, fp8: FP8Weight | None, silu: bool = False
) -> torch.Tensor:
    """x @ weight^T (silu of it); with `fp8` = (qweight, row scales) through the float8 weights instead,
    whose batch-1 GEMV applies the silu in its store."""
    if fp8 is None:
        y = ops.linear(x, weight)
        return F.silu(y) if silu else y
    return ops.quant_linear(x, fp8[0], fp8[1], None, None, "channel", None, silu=silu)


class MtpHead(nn.Module):
    """The mask embeddings and the sampler head; its state_dict keys are mtp_head.safetensors' names."""

    def __init__(
        self, num_mask_tokens: int, hidden_size: int, eps: float, draft_vocab_size: int | None = None
    ):
        super().__init__()
        h = hidden_size
        self.eps = eps
        self.mask_embeddings = nn.Parameter(torch.empty(num_mask_tokens, h), requires_grad=False)
        self.sampler = nn.Module()
        self.sampler.fc1, self.sampler.fc2, self.sampler.norm = _Weight(h, 2 * h), _Weight(h, h), _Weight(h)
        self.source: MtpDir | None = None  # the checked directory, once loaded by load_mtp_head
        # the draft vocabulary (ascending ids) and its rows of the LM head (bind_logits_weight)
        ids = torch.empty(draft_vocab_size, dtype=torch.long) if draft_vocab_size else None
        self.register_buffer(DRAFT_IDS, ids)
        self.draft_weight: torch.Tensor | None = None
        self.fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # quantize_fp8: (qweight, scale) by use
        self.chain = None  # engine.spec.mtp_chain.DraftChain once set up (with a draft vocabulary)

    def bind_logits_weight(self, weight: torch.Tensor) -> None:
        """Keep the draft vocabulary's rows of the target's LM head `weight` [V, H] (a copy of N rows);
        without a draft vocabulary, nothing: drafts then come from the target's compute_logits."""
        if self.draft_token_ids is not None:
            self.draft_weight = weight.index_select(0, self.draft_token_ids).contiguous()

    def quantize_fp8(self) -> None:
        """speculative_config.quantization "fp8": fc1, fc2 and the bound draft rows in float8 with one
        scale per row, so the head's k passes a step read about half the bytes. Drafts may change a
        little; the output never does (verification). Call after bind_logits_weight."""
        weights = {"fc1": self.sampler.fc1.weight, "fc2": self.sampler.fc2.weight, "draft": self.draft_weight}
        self.fp8 = {name: quantize_fp8_rows(w) for name, w in weights.items() if w is not None}
        if self.draft_weight is not None:
            self.draft_weight = self.fp8["draft"][0]  # the model-dtype copy of N LM-head rows is freed

    def _linear(self, x: torch.Tensor, name: str, weight: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """x @ weight^T (silu of it), through its float8 copy after quantize_fp8."""
        return head_linear(x, weight, self.fp8.get(name), silu)

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
        """hidden [N, H] at mask positions, prev_ids [N] (the token each draft follows) -> logits [N, V]
        over the whole vocabulary; embed / compute_logits: the target model's (any family's scale and
        softcap apply)."""
        return compute_logits(self._state(hidden, prev_ids, embed))

    def _state(self, hidden: torch.Tensor, prev_ids: torch.Tensor, embed: Callable) -> torch.Tensor:
        """The sampler's output [N, H], normalised: what the LM head scores."""
        e = embed(prev_ids).to(hidden.dtype)
        act = self._linear(torch.cat([hidden, e], dim=-1), "fc1", self.sampler.fc1.weight, silu=True)
        down = self._linear(act, "fc2", self.sampler.fc2.weight)
        # norm(hidden + down) with the residual add in the norm's launch (the sum rounded to the dtype
        # first, as a separate add would store it)
        return ops.add_rms_norm(down, hidden, self.sampler.norm.weight, self.eps)[0]

    def draft(
        self,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The draft tokens [N] int64: argmax of draft_logits (lowest id on ties), over the draft
        vocabulary when one is bound (the LM head's rows alone: a softcap is monotonic, so it is left out)."""
        if self.draft_weight is None:
            return ops.argmax(self.draft_logits(hidden, prev_ids, embed, compute_logits))
        scores = self._linear(self._state(hidden, prev_ids, embed), "draft", self.draft_weight)
        return ops.argmax(scores, ids=self.draft_token_ids)


@dataclass(frozen=True)
class MtpDir:
    """A checked MTP directory (only JSON and safetensors headers read)."""

    path: Path
    num_mask_tokens: int  # K: mask tokens the head was trained for (>= num_speculative_tokens)
    hidden_size: int
    adapter: AdapterSpec  # the gated LoRA, checked against the target's projections
    draft_vocab_size: int | None = None  # N: the head drafts among N tokens (draft_token_ids)

    @property
    def lora_rank(self) -> int:
        """The largest rank of the adapter's modules: the LoRA slots must be at least this wide."""
        return max([self.adapter.rank, *(r for _, _, r in self.adapter.modules.values())])

    @property
    def lora_request(self) -> LoRARequest:
        """The adapter as engine/lora's host cache and slots know adapters."""
        return LoRARequest(LORA_NAME, 1, str(self.path))


def read_mtp_config(path: Path, target: TargetConfig, k: int) -> tuple[int, int, int | None]:
    """(num_mask_tokens, hidden_size, draft_vocab_size or None) of mtp_config.json, checked against the
    target and k."""
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
    vocab = cfg.get("draft_vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab):
        raise _error(file, f"draft_vocab_size is {vocab!r}, expected an integer >= 1 or no such key; {_FIX}")
    if vocab is not None and vocab > target.vocab_size:
        raise _error(
            file,
            f"draft_vocab_size is {vocab} but the target's vocabulary has {target.vocab_size} tokens; {_FIX}",
        )
    return num, hidden, vocab


def _check_head_file(path: Path, num_mask_tokens: int, hidden_size: int, draft_vocab: int | None) -> None:
    """Every tensor of mtp_head.safetensors present, of its shape and dtype (float; integer ids);
    nothing else."""
    file = path / HEAD_FILE
    if not file.is_file():
        raise _error(path, f"no {HEAD_FILE}; {_FIX}")
    expected = tensor_shapes(num_mask_tokens, hidden_size, draft_vocab)
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
        allowed = ID_DTYPES if name == DRAFT_IDS else FLOAT_DTYPES
        if dtype not in allowed:
            raise _error(file, f"tensor {name} has dtype {dtype}, expected one of {list(allowed)}; {_FIX}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise _error(file, f"unexpected tensor(s) {extra}; it holds only {sorted(expected)}; {_FIX}")


def check_mtp_dir(path: str | Path, target: TargetConfig, k: int) -> MtpDir:
    """Check the gated_lora_mtp directory at `path` against the target's config (an
    engine.models.config.ModelConfig) and k = num_speculative_tokens; reads no tensor data."""
    path = Path(path)
    if not path.is_dir():
        raise _error(path, "is not a directory; give the gated_lora_mtp directory")
    num, hidden, draft_vocab = read_mtp_config(path, target, k)
    _check_head_file(path, num, hidden, draft_vocab)
    try:  # no limit here: a too-large rank gets this module's own fix below
        adapter = check_adapter(path, ModuleShapes.of(target), sys.maxsize)
    except LoRAError as exc:
        raise ValueError(f"speculative_config.model: the gated LoRA: {exc}") from exc
    mtp = MtpDir(path, num, hidden, adapter, draft_vocab)
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
    head = MtpHead(mtp.num_mask_tokens, mtp.hidden_size, target.rms_norm_eps, mtp.draft_vocab_size)
    file = mtp.path / HEAD_FILE
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise _error(file, f"cannot be read ({exc}); {_FIX}") from None
    if DRAFT_IDS in tensors:
        tensors[DRAFT_IDS] = _draft_ids(tensors[DRAFT_IDS], target.vocab_size, file)
    head.load_state_dict(tensors, strict=True)
    head.to(dtype=dtype, device=device)
    head.source = mtp
    return head


def _draft_ids(ids: torch.Tensor, vocab_size: int, file: Path) -> torch.Tensor:
    """The draft vocabulary in ascending order (so that ties go to the lowest id), checked."""
    ids = ids.to(torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise _error(
            file, f"{DRAFT_IDS} holds ids outside the target's vocabulary 0..{vocab_size - 1}; {_FIX}"
        )
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        raise _error(file, f"{DRAFT_IDS} repeats ids; each token may appear once; {_FIX}")
    return ids


def load_mtp_lora(mtp: MtpDir, dtype: torch.dtype, pin: bool = False) -> AdapterWeights:
    """The gated LoRA in host memory (scale folded into B), for LoRALinear.load_slot of every LoRA layer
    (`.modules`) or a LoRAManager's host cache (`.request` is mtp.lora_request)."""
    return load_adapter(mtp.lora_request, mtp.adapter, dtype, pin)

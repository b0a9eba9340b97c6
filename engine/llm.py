"""Offline API: `LLM(model_path, **config).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_masks: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: entry 0 None, then each prompt token's logprob given those before
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def absorb(self, out: RequestOutput) -> None:
        """Fold one incremental RequestOutput into the accumulated result."""
        self.cached_tokens = out.cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for d in out.outputs:
            o = self.outputs[d.index]
            o.token_ids += d.token_ids
            o.text += d.text
            o.token_masks += d.token_masks
            if d.logprobs is not None:
                o.logprobs = (o.logprobs or []) + d.logprobs
            o.finish_reason = d.finish_reason or o.finish_reason
            o.error = d.error or o.error


class LLM:
    def __init__(self, model: str, **config):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in order. A prompt is a string, token ids, or chat messages.
        lora_request: the adapter of every prompt, or a list with one entry (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()]
        if len(params) == 1:
            params = params * len(prompts)  # one SamplingParams for every prompt
        # one output per request, at its end: no text or output objects per step (as vLLM's LLM does)
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(
                f"lora_request: {len(loras)} entries for {len(prompts)} prompts; give one per prompt"
            )
        results: dict[str, GenerationResult] = {}
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            rid = self.engine.add_request(prompt, p, lora_request=lora)
            ids = self.engine.state.requests[rid].prompt_ids
            results[rid] = GenerationResult(rid, ids, [CompletionOutput(i) for i in range(p.n)])
        bar = tqdm(total=len(results), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id].absorb(out)
                bar.update(out.finished)
        bar.close()
        return list(results.values())

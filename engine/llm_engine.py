"""LLMEngine: the synchronous core. add_request / step / abort; no threads, no network.

step():  schedule -> run the model -> postprocess (engine/token_sink.py)

The offline API (engine/llm.py) drives it in its own process; the server drives it in the engine core
process (engine/core.py) with detokenize=False and `step_records`, which leave text to the replica.

With async scheduling, a decode step is followed on the device by the next one, launched before the
host has seen the first one's tokens, so the device never waits for the host's token and text work.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable

from engine import admission, structured
from engine.admission import Prompt
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.core_messages import Record
from engine.errors import InvalidRequestError, QueueFullError
from engine.faults import FaultInjector
from engine.model_runner import DeferredSample, ModelRunner
from engine.output_processor import OutputProcessor, PromptLogprobs
from engine.outputs import RequestOutput
from engine.request import Request
from engine.request_outputs import OutputBuilder
from engine.sampler import PendingSample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculator import Speculator
from engine.token_sink import TokenSink
from engine.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.load.model)
        self.runner = ModelRunner(config)
        mc = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.kv_spec.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        spec = config.speculative
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        self.faults = FaultInjector(config.fault_injection, self.tokenizer.decode)
        self._fault = self.faults.checker()  # None unless fault injection is on (tests)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos, self.max_model_len, self.faults, detokenize)
        self.detokenize = detokenize
        self.prompt_logprobs = PromptLogprobs()  # of requests with SamplingParams.prompt_logprobs
        sc = config.scheduler
        self.limits = admission.Limits(
            self.max_model_len, mc.vocab_size, self.block_manager.num_blocks, self.block_manager.block_size,
            sc.max_num_seqs, sc.max_waiting,
        )  # fmt: skip
        # llguidance's token trie, built in the background before the first structured request needs it
        structured.warm_up(self.tokenizer, self.limits.vocab_size)
        self.requests: dict[str, Request] = {}
        # launched, not yet completed; its draw is a DeferredSample (rows with a grammar or penalties:
        # SchedulerOutput.draw_late) from its launch until the next _step joins it, its mask fill begun
        # by _start_draw at the end of the _step that launched it
        self._ahead: tuple[SchedulerOutput, PendingSample | DeferredSample | None] | None = None
        self._ids = itertools.count()
        self.stats = {
            "num_aborts": 0,
            "num_errors": 0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
        }
        self.outputs = OutputBuilder(
            self.processor, self.prompt_logprobs, self.requests, self.stats, detokenize
        )  # fmt: skip
        self.sink = TokenSink(self.scheduler, self.processor, self.outputs, self.prompt_logprobs,
                              self.requests, self.stats, self.speculator)  # fmt: skip
        # What exists now (model, tokenizer, torch and Triton state) lives as long as the engine. Frozen,
        # it is out of the cyclic collector's reach: otherwise each full collection scans all of it and
        # stalls the step loop (0.25-0.3 s once per workload-(c) run on an H200 host; vLLM does the same).
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        return admission.tokenize(self.tokenizer, prompt, self.limits.vocab_size)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        admission.check(ids, params, self.limits, self.tokenizer)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError("the engine queue is full: retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        request = Request(request_id, ids, params, arrival_time or time.time())
        if params.structured is not None:  # compiled (and cached) by admission.check just above
            compiler = structured.compiler_for(self.tokenizer, self.limits.vocab_size)
            request.seqs[0].grammar = self.runner.bitmasks.new_state(params.structured, compiler)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.stats["prompt_tokens_total"] += len(ids)
        if self._fault is not None:  # a test hook: the loop that adds this request dies
            self._fault("loop", request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish the request now and free its blocks; returns its final output (or None if unknown)."""
        request = self._abort(request_id)
        return self.outputs.finish_output(request) if request is not None else None

    def abort_record(self, request_id: str) -> Record | None:
        """`abort` for the engine core: the request's final record instead of a RequestOutput."""
        request = self._abort(request_id)
        return self.outputs.finish_record(request) if request is not None else None

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish one sample now: its caller found a stop string in its text (the engine core's replica
        does the text work). The request's next record carries the sample's end."""
        request = self.requests.get(request_id)
        if request is None or index >= len(request.seqs):
            return
        seq = request.seqs[index]
        if not seq.finished:
            self.scheduler.finish(seq, "stop")
        self.sink.touch(request)

    def _abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort(request, "abort")
        self.stats["num_aborts"] += 1
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step loop
    def step(self) -> list[RequestOutput]:
        """schedule -> run on the device -> postprocess.

        While the device computes this step, the host turns the previous step's tokens into text and
        outputs (`_emit`), so that work costs no GPU time; outputs therefore trail tokens by one step.
        A decode step also gets its successor launched behind it (`_launch_next`) before its tokens
        are waited for: the next call runs that one instead of scheduling afresh.
        """
        return self._step(self.sink.emit, self.outputs.finish_output)

    def step_records(self) -> list[Record]:
        """`step` for the engine core: compact per-request records of token ids, no text, no objects.

        Records are cheap, so they are made right after this step's tokens arrive rather than during
        the next step: a token reaches the caller one step sooner (the device meanwhile runs the step
        launched ahead, when there is one)."""
        return self._step(self.sink.emit_records, self.outputs.finish_record, emit_first=False)

    def _step(
        self, emit: Callable[[], list], finish: Callable[[Request], object], emit_first: bool = True
    ) -> list:
        if self._ahead is not None and not self.scheduler.running:
            self._drop_ahead()  # every sequence in it has finished since: nothing to wait for
        out, pending = self._ahead or self._schedule_and_launch()
        # The step after `out` is scheduled now and launched behind it, fed `out`'s sampled ids on the
        # device. A deferred draw of `out` has its mask fill running (begun by the previous call): it
        # is joined only after the scheduling, and after the emit when the emit comes first.
        nxt = self.scheduler.schedule_ahead(out) if pending is not None and self._may_run_ahead() else None
        outputs = None
        if emit_first and isinstance(pending, DeferredSample):
            outputs = emit()  # the device is still on `out`'s forward: it cannot sample before the join
        pending = self._finish_draw(out, pending)
        ahead = self._launch_next(nxt, pending)
        if emit_first and outputs is None:
            outputs = emit()
        received = self.sink.receive(out, pending)
        self._ahead = self._start_draw(ahead)
        self.sink.complete(out, received)
        if not emit_first:
            outputs = emit()
        failed = self.sink.take_failed()  # each failed request gets one final output
        return outputs + [finish(r) for r in failed if r.request_id in self.requests]

    def _schedule_and_launch(self) -> tuple[SchedulerOutput, PendingSample | None]:
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running)
        out = self.scheduler.schedule()
        return out, self._launch(out)

    def _may_run_ahead(self) -> bool:
        """A step scheduled ahead cannot speculate (its inputs are not on the host yet): none is while
        some sequence would."""
        return self.speculator is None or self.speculator.idle(self.scheduler.running)

    def _launch_next(
        self, nxt: SchedulerOutput | None, pending: PendingSample | None
    ) -> tuple[SchedulerOutput, PendingSample | DeferredSample | None] | None:
        """Launch a step scheduled ahead, its input ids the previous step's samples (`pending`)."""
        if nxt is None:
            return None
        if pending is None:  # the previous step's draw failed: its requests (all of nxt's) have failed
            self.sink.fail_chunks(nxt, RuntimeError("the previous step's draw failed"))
            return nxt, None
        return nxt, self._launch(nxt, pending)

    def _finish_draw(self, out: SchedulerOutput, pending):
        """A deferred draw joined and enqueued (a failed one fails its requests: None)."""
        if not isinstance(pending, DeferredSample):
            return pending
        try:
            return pending.finish()
        except Exception as exc:
            self.sink.fail_chunks(out, exc)
            return None

    def _start_draw(self, ahead: tuple[SchedulerOutput, object] | None):
        """A step launched ahead whose draw reads host state (grammars, penalties) can begin it only
        now: `receive` has just handed the previous step's tokens to their matchers. The matchers'
        consume and mask fill run on a worker thread while those tokens are appended, this step's
        outputs are emitted and the next one is scheduled; the device runs the step's forward
        meanwhile. Penalties read the token history at the join, after the appends."""
        if ahead is not None and isinstance(ahead[1], DeferredSample):
            try:
                ahead[1].start()
            except Exception as exc:
                self.sink.fail_chunks(ahead[0], exc)
                return ahead[0], None
        return ahead

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead, after any mask fill of it has finished (its buffer is reused)."""
        _, pending = self._ahead
        self._ahead = None
        if isinstance(pending, DeferredSample):
            with contextlib.suppress(Exception):  # its requests have all finished
                pending.finish()

    def _launch(self, out: SchedulerOutput, prev: PendingSample | None = None) -> PendingSample | None:
        now = time.time()
        for chunk in out.chunks:
            metrics = chunk.seq.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        try:
            return self.runner.execute(out, prev) if out.chunks else None
        except Exception as exc:  # a failed forward fails the requests in it, never the engine
            self.sink.fail_chunks(out, exc)
            return None

    # ------------------------------------------------------------------ introspection
    def audit(self) -> list[str]:
        return self.block_manager.audit(self.scheduler.live_tables())

    def prefix_summary(self, max_hashes: int) -> tuple[int, list[int]]:
        """A bounded sample of the prefix cache's block hashes (BlockManager.prefix_summary)."""
        return self.block_manager.prefix_summary(max_hashes)

    def get_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used,
            "kv_blocks_total": bm.num_blocks,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.stats,
            **(self.speculator.get_stats() if self.speculator is not None else {}),
        }


OnOutput = Callable[[RequestOutput], None]

"""LLMEngine: the synchronous core. add_request / step / abort; no threads, no network.

step():  schedule -> run the model -> postprocess (engine/output/sink.py)

The offline API (engine/llm.py) drives it in its own process; the server drives it in the engine core
process (engine/core/process.py) with detokenize=False and `step_records`, which leave text to the replica.

With async scheduling, each step is followed on the device by the next one, launched before the host
has seen the first one's tokens, so the device never waits for the host's token and text work.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable
from typing import TypeVar

from engine.config import EngineConfig
from engine.core.faults import FaultInjector
from engine.core.messages import Record, Records
from engine.errors import InvalidRequestError, LoRAError, QueueFullError
from engine.lora.adapter import ModuleShapes
from engine.lora.admission import LoRAAdmission
from engine.lora.request import LoRARequest
from engine.output.builder import OutputBuilder
from engine.output.processor import OutputProcessor
from engine.output.sink import TokenSink
from engine.output.state import EngineState
from engine.outputs import RequestOutput
from engine.runner.busy_estimate import BusyEstimate
from engine.runner.in_flight import Draw, InFlightStep
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sched import admission
from engine.sched.admission import Prompt
from engine.sched.block_manager import BlockManager
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from engine.spec.speculator import Speculator
from engine.structured import compiler as structured
from engine.tokenizer import Tokenizer

T = TypeVar("T", list[RequestOutput], Records)  # what a step hands out
# waiting sequences whose adapters are read ahead of a schedule (LLMEngine._stage_adapters)
STAGE_SCAN = 64


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        self.config, self.detokenize = config, detokenize
        self.tokenizer = Tokenizer.from_dir(config.load.model)
        self.runner = ModelRunner(config)
        self.busy = BusyEstimate.for_device(self.runner.device)  # stats' gpu_busy_estimate
        self.max_model_len = self.runner.max_model_len
        self.kv_offload = self.runner.kv_offload  # the host KV tier's copies; None when off
        self.block_manager = BlockManager(
            self.runner.kv_spec.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            self.kv_offload.num_slots if self.kv_offload is not None else 0,
        )  # fmt: skip
        max_loras = config.max_loras if config.enable_lora else None  # adapters running at once
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, max_loras)
        # the base projections' shapes adapters are checked against (also by CoreClient); None: no LoRA
        self.lora_shapes = ModuleShapes.of(self.runner.model_config) if config.enable_lora else None
        self.lora_admission = LoRAAdmission(self.lora_shapes, config.max_lora_rank)
        spec = config.speculative
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        self.faults = FaultInjector(config.fault_injection, self.tokenizer.decode)
        self._fault = self.faults.checker()  # None unless fault injection is on (tests)
        self.limits = self._limits()
        # llguidance's token trie, built in the background before the first structured request needs it
        structured.warm_up(self.tokenizer, self.limits.vocab_size)
        self.state = EngineState()  # live requests, counters, prompt logprobs: shared with sink and outputs
        self._build_output_path()
        self._ahead: InFlightStep | None = None  # launched behind the previous step, not yet taken in
        self._ids = itertools.count()
        # What exists now (model, tokenizer, torch and Triton state) lives as long as the engine. Frozen,
        # it is out of the cyclic collector's reach: otherwise each full collection scans all of it and
        # stalls the step loop (vLLM does the same).
        gc.collect()
        gc.freeze()

    def _limits(self) -> admission.Limits:
        sc, bm = self.config.scheduler, self.block_manager
        vocab = self.runner.model_config.vocab_size
        return admission.Limits(
            self.max_model_len, vocab, bm.num_blocks, bm.block_size, sc.max_num_seqs, sc.max_waiting
        )

    def _build_output_path(self) -> None:
        """The processor (tokens to finish reasons and text), the builder of outputs, and the sink."""
        eos = set(self.runner.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.processor = OutputProcessor(
            self.tokenizer, eos, self.max_model_len, self.faults, self.detokenize
        )
        self.outputs = OutputBuilder(self.processor, self.state, self.detokenize)
        self.sink = TokenSink(self.scheduler, self.processor, self.outputs, self.state, self.speculator)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        return admission.tokenize(self.tokenizer, prompt, self.limits.vocab_size)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (lora_request: the adapter it runs with; None: the base model)."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        admission.check(ids, params, self.limits, self.tokenizer)
        self.lora_admission.check(lora_request)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError("the engine queue is full: retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.state.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        request = Request(request_id, ids, params, arrival_time or time.time(), lora_request=lora_request)
        request.metrics.added_time = time.time()
        if params.structured is not None:  # compiled (and cached) by admission.check just above
            compiler = structured.compiler_for(self.tokenizer, self.limits.vocab_size)
            request.seqs[0].grammar = self.runner.bitmasks.new_state(params.structured, compiler)
        self.state.requests[request_id] = request
        self.scheduler.add(request)
        self.state.counters.prompt_tokens_total += len(ids)
        if self._fault is not None:  # a test hook: the loop that adds this request dies
            self._fault("loop", request)
        return request_id

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check the adapter and read it into the host cache (LRU, max_cpu_loras); LoRAError if bad."""
        self.lora_admission.check(lora_request)
        self.runner.lora.add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Drop the adapter from the host cache and from the GPU slots no running request holds (those
        finish with it); False when the host cache did not hold it."""
        self.lora_admission.forget(lora_name)
        if self.runner.lora is None:
            return False
        return self.runner.lora.remove(lora_name, self.scheduler.running_loras() or set())

    def list_loras(self) -> list[str]:
        """The adapters in the host cache, least recently used first."""
        return [] if self.runner.lora is None else self.runner.lora.host.names()

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
        request = self.state.requests.get(request_id)
        if request is None or index >= len(request.seqs):
            return
        seq = request.seqs[index]
        if not seq.finished:
            self.scheduler.finish(seq, "stop")
        self.sink.touch(request)

    def _abort(self, request_id: str) -> Request | None:
        request = self.state.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort(request, "abort")
        self.state.counters.num_aborts += 1
        return request

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)

    # ------------------------------------------------------------------ the step loop
    def step(self) -> list[RequestOutput]:
        """schedule -> run on the device -> postprocess.

        While the device computes this step, the host turns the previous step's tokens into text and
        outputs (`TokenSink.emit`), so that work costs no GPU time; outputs therefore trail tokens by
        one step. Each step also gets its successor launched behind it (`_launch_next`) before its tokens
        are waited for, where the scheduler allows: the next call runs that one instead of scheduling
        afresh.
        """
        return self._step(self.sink.emit, self._with_final_outputs)

    def step_records(self) -> Records:
        """`step` for the engine core: compact records of token ids, no text, no objects.

        Records are cheap, so they are made right after this step's tokens arrive rather than during
        the next step: a token reaches the caller one step sooner (the device meanwhile runs the step
        launched ahead, when there is one)."""
        return self._step(self.sink.emit_records, self._with_final_records, emit_first=False)

    def _step(
        self, emit: Callable[[], T], with_finals: Callable[[T, list[Request]], T], emit_first=True
    ) -> T:
        self._take_completed_copies()  # host-tier copies complete since the last step
        if self._ahead is not None and not self.scheduler.running:
            self._ahead.drop()  # every sequence in it has finished since: nothing to wait for
            self._ahead = None
        step = self._ahead or self._schedule_and_launch()
        # The step after this one is scheduled now and launched behind it, fed its sampled ids on the
        # device. A deferred draw has its mask fill running (begun by the previous call): it is joined
        # only after the scheduling, and after the emit when the emit comes first.
        nxt = self._schedule_ahead(step.out)
        outputs = None
        if emit_first and step.deferred:
            outputs = emit()  # the device is still on this step's forward: it cannot sample before the join
        deferred = step.deferred
        prev = step.finish(self.sink.fail_chunks)
        if deferred:  # its sampling, the step's last kernels, was enqueued just now
            self.busy.end()
        ahead = self._launch_next(nxt, prev)
        if emit_first and outputs is None:
            outputs = emit()
        received = self.sink.receive(step.out, step.draw)
        if ahead is not None:  # `receive` has just handed this step's tokens to their grammars
            ahead.start(self.sink.fail_chunks)
        self._ahead = ahead
        self.sink.complete(step.out, received)
        if not emit_first:
            outputs = emit()
        failed = [r for r in self.sink.take_failed() if self.state.is_live(r)]
        return with_finals(outputs, failed) if failed else outputs  # one final output per failure

    def _with_final_outputs(self, outputs: list[RequestOutput], failed: list[Request]) -> list:
        return outputs + [self.outputs.finish_output(r) for r in failed]

    def _with_final_records(self, records: Records, failed: list[Request]) -> Records:
        return records.concat(self.outputs.records(failed))

    def _schedule_and_launch(self) -> InFlightStep:
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running)
        self._stage_adapters()
        return self._launch(self.scheduler.schedule())

    def _stage_adapters(self) -> None:
        """Read the adapters the next admissions may need into the host cache before scheduling, so an
        adapter whose files broke after its requests were accepted fails those requests here, never the
        step that would copy it into a slot (and every other request in that step). At most max_loras
        adapters, from the first STAGE_SCAN waiting sequences: a step admits no more than that."""
        lora = self.runner.lora
        if lora is None or not self.scheduler.waiting:
            return
        staged: set = set()
        for seq in list(itertools.islice(self.scheduler.waiting, STAGE_SCAN)):
            request = seq.request.lora_request
            if request is None or request.key in staged:
                continue
            if len(staged) == self.config.max_loras:
                return
            staged.add(request.key)
            try:
                lora.host.get(request)
            except LoRAError as exc:
                self.sink.fail(seq.request, str(exc), exc)

    def _schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `prev`, or None. A step scheduled ahead cannot speculate (its inputs are not on
        the host yet): none is while some sequence would, judged on the host's state, one step behind.
        So a speculating engine runs only decodes ahead (as they were, the state stays right), and a
        draft model mirrors no step scheduled ahead (engine/runner/draft_runner.py): a prompt chunk it
        missed would leave its KV stale."""
        if self.speculator is not None and not self.speculator.idle(self.scheduler.running):
            return None
        self._stage_adapters()
        return self.scheduler.schedule_ahead(prev, decodes_only=self.speculator is not None)

    def _launch_next(self, nxt: SchedulerOutput | None, prev: Draw | None) -> InFlightStep | None:
        """Launch a step scheduled ahead, its input ids the previous step's samples (`prev`). A draw
        that reads host state (grammars, penalties) begins only once `receive` has handed the previous
        step's tokens to their matchers (InFlightStep.start): the matchers' consume and mask fill then
        run on a worker thread while those tokens are appended, the outputs are emitted and the next
        step is scheduled, and the device runs this step's forward meanwhile. Penalties read the token
        history at the join (InFlightStep.finish), after the appends."""
        if nxt is None:
            return None
        if prev is None and nxt.prev_rows:
            # the previous step's draw failed, failing its requests: nxt is dropped unlaunched, and the
            # next schedule() takes its other sequences from where they stand (they keep the blocks
            # reserved for it); its host-tier copies are decided, so they run all the same
            if nxt.kv_transfers:
                self.kv_offload.submit(nxt.kv_transfers)
            return None
        return self._launch(nxt, prev)

    def _launch(self, out: SchedulerOutput, prev: Draw | None = None) -> InFlightStep:
        now = time.time()
        for chunk in out.chunks:
            metrics = chunk.seq.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        if out.kv_transfers:  # before the forward; a failed copy fails the engine (kv_offload.py)
            self.kv_offload.submit(out.kv_transfers)
        if out.kv_waits:  # copies in from the host tier that this step's new sequences read
            self.kv_offload.wait(out.kv_waits)
        if not out.chunks:
            return InFlightStep(out, None)
        try:
            self.busy.begin()
            step = InFlightStep(out, self.runner.execute(out, prev))
        except Exception as exc:  # a failed forward fails the requests in it, never the engine
            self.sink.fail_chunks(out, exc)
            return InFlightStep(out, None)
        if not step.deferred:  # a deferred draw enqueues its sampling later (see _step)
            self.busy.end()
        return step

    # ------------------------------------------------------------------ introspection
    def check_workers(self) -> None:
        """Raise TPWorkerError if a tensor-parallel worker has died. A step finds that out by itself;
        an idle engine core calls this between its polls, so the death fails it without a request."""
        if self.runner.tp is not None:
            self.runner.tp.check()

    def audit(self) -> list[str]:
        """KV leaks and double frees in both tiers. Host-tier copies complete by now are taken in
        first: an idle engine takes no step that would."""
        self._take_completed_copies()
        return self.block_manager.audit(self.scheduler.live_tables())

    def _take_completed_copies(self) -> None:
        if self.kv_offload is not None:
            self.block_manager.complete_transfers(self.kv_offload.poll())

    def prefix_summary(self, max_hashes: int) -> tuple[int, list[int], list[int]]:
        """A bounded sample of the prefix cache's block hashes (BlockManager.prefix_summary) and of the
        host tier's at the same stride (routers count those at a lower weight), together at most
        `max_hashes`."""
        bm = self.block_manager
        if bm.host is None:
            return (*bm.prefix_summary(max_hashes), [])
        return bm.host.summary_beside(*bm.prefix_summary(max_hashes // 2), max_hashes)

    def get_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used,
            "kv_blocks_total": bm.num_blocks,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "gpu_busy_estimate": self.busy.estimate(),  # None without CUDA (engine/runner/busy_estimate.py)
            **self.state.counters.as_dict(),
            **(self.kv_offload.stats(bm) if self.kv_offload is not None else {}),
            **(self.speculator.get_stats() if self.speculator is not None else {}),
        }


OnOutput = Callable[[RequestOutput], None]

"""A stand-in for the LLMEngine inside the engine core process, for measuring the serving path alone.

It loads no model. Every `step_ms` it gives each running request one token, as a decode step of a
real engine would, and finishes a request after max_tokens (reason "length"; max_tokens 0: at once,
with no token). Everything after the
core (records, the replica's detokenization and fan-out, Serve's streaming, the ingress, the proxy)
is the real code, so a served run against it shows the Serve path's own ceiling: at P streams the
ideal is P * 1000 / step_ms tokens per second. Enabled by `null_core_step_ms` in serve_config.yaml.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from engine.config import EngineConfig
from engine.core.messages import FinalMetrics, Record, Records, Sample
from engine.errors import QueueFullError
from engine.sched import admission


class _NullRequest:
    def __init__(self, rid: str, ids: list[int], params, arrival: float):
        self.request_id, self.prompt_ids, self.params = rid, ids, params
        self.arrival, self.emitted, self.first_scheduled, self.first_token = arrival, 0, None, None


class NullEngine:
    def __init__(self, config: EngineConfig, step_ms: float):
        if step_ms <= 0:
            raise ValueError(f"null_core_step_ms: must be > 0, got {step_ms}")
        hf = json.loads((Path(config.load.model) / "config.json").read_text())
        max_len = config.load.max_model_len or min(hf.get("max_position_embeddings", 8192), 8192)
        sc = config.scheduler
        self.limits = admission.Limits(
            max_len, hf["vocab_size"], 1 << 20, 16, sc.max_num_seqs, sc.max_waiting
        )
        self.step_s = step_ms / 1000.0
        self.requests: dict[str, _NullRequest] = {}
        self.waiting: deque[_NullRequest] = deque()
        self.running: list[_NullRequest] = []
        self.stats = {
            "num_aborts": 0,
            "num_errors": 0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
        }
        self._next_step = time.perf_counter()

    def add_request(self, ids: list[int], params, request_id: str, arrival_time: float) -> str:
        if len(self.waiting) >= self.limits.max_waiting:
            raise QueueFullError("the engine queue is full: retry later")
        request = _NullRequest(request_id, ids, params, arrival_time)
        self.requests[request_id] = request
        self.waiting.append(request)
        self.stats["prompt_tokens_total"] += len(ids)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step_records(self) -> Records:
        """Wait for the next step's time, then one token for every running request."""
        delay = self._next_step - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._next_step = max(self._next_step + self.step_s, time.perf_counter())
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting.popleft()
            request.first_scheduled = time.time()
            self.running.append(request)
        records, still, now = [], [], time.time()
        for r in self.running:
            tokens = [8 + (hash(r.request_id) + r.emitted) % (self.limits.vocab_size - 8)]
            if r.params.max_tokens == 0:
                tokens = []  # score-only: finishes by length with no token
            r.emitted += len(tokens)
            r.first_token = r.first_token or now
            done = r.emitted >= r.params.max_tokens
            sample = Sample(0, tokens, [1] * len(tokens), finish_reason="length" if done else None)
            times = FinalMetrics(r.first_scheduled, r.first_token) if done else None
            records.append(Record(r.request_id, [sample], done, final_metrics=times))
            if done:
                self._drop(r)
            else:
                still.append(r)
        self.running = still
        return Records.of(records)

    def abort_record(self, rid: str, reason: str = "abort") -> Record | None:
        request = self.requests.get(rid)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._drop(request)
        self.stats["num_aborts"] += reason == "abort"
        times = FinalMetrics(request.first_scheduled, request.first_token)
        return Record(rid, [Sample(0, [], [], finish_reason=reason)], True, final_metrics=times)

    def stop_sample(self, rid: str, index: int) -> None:
        self.abort_record(rid, "stop")

    def _drop(self, request: _NullRequest) -> None:
        self.requests.pop(request.request_id, None)
        self.stats["generation_tokens_total"] += request.emitted

    def get_stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_blocks_used": 0,
            "kv_blocks_total": self.limits.num_blocks,
            "prefix_cache_hit_rate": 0.0,
            "num_preemptions": 0,
            **self.stats,
        }

    def prefix_summary(self, max_hashes: int) -> tuple[int, list[int], list[int]]:
        return 1, [], []  # no KV cache

    def audit(self) -> list[str]:
        return []

    def check_workers(self) -> None:
        pass  # no model, no tensor-parallel workers

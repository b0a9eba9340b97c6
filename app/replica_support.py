"""Small helpers of the engine replica (app/engine_deployment.py): its one log line per request, the
flush of Serve's buffered log records, and process memory readings."""

from __future__ import annotations

import logging
import logging.handlers
import os

from engine.outputs import RequestOutput

logger = logging.getLogger("ray.serve")


def log_finished(out: RequestOutput, received: float | None = None, sent: float | None = None) -> None:
    """The one INFO line per request: how it ended, its sizes, and where its time went, from its arrival
    at the ingress: sent on by the ingress (`sent`), received by this replica (`received`; both
    time.time()), taken by the engine core, first scheduled there, first token sampled there, first token
    here, finished."""
    m = out.metrics
    ms = lambda t: f"{1000 * (t - m.arrival_time):.1f}" if t is not None else "-"
    reasons = ",".join(sorted({d.finish_reason for d in out.outputs if d.finish_reason}))
    spec = ""
    if m.spec_draft_tokens:  # speculative decoding: how many of its proposals were accepted
        spec = f"; accepted {m.spec_accepted_tokens}/{m.spec_draft_tokens} proposals"
    logger.info(
        "request %s %s: prompt %d, completion %d, cached %d tokens; "
        "in ingress %s ms, to replica %s ms, to core %s ms, queue %s ms, engine ttft %s ms, ttft %s ms, "
        "e2e %s ms%s",
        out.request_id, reasons or "finished", out.prompt_tokens, out.completion_tokens, out.cached_tokens,
        ms(sent), ms(received), ms(m.added_time), ms(m.first_scheduled_time), ms(m.engine_token_time),
        ms(m.first_token_time), ms(m.finished_time), spec,
    )  # fmt: skip


def flush_log_buffer() -> None:
    """Serve's throughput mode buffers a replica's log records (up to 1000, written when the buffer
    fills): write them out once per stats interval, so a request's line shows within about a second."""
    for handler in logger.handlers:
        if isinstance(handler, logging.handlers.MemoryHandler):
            handler.flush()


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc; None elsewhere or when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None

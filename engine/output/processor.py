"""Turns sampled tokens into per-request outputs: forced tokens, stops, text deltas, finish reasons.

Token-level work (`append`, between two steps unless the next one was launched ahead), per sample:
  1. budget forcing: a sampled suppress token before the budget is spent becomes a replacement string;
  2. the calculator tool: a sampled python-end marker evaluates the expression since the last
     python-start marker and forces "<output_start> result <output_end>" into this sequence only;
  3. stop token ids / EOS (a completed grammar admits only EOS), max_tokens and max_model_len;
Text-level work (`detokenize`, deferred until the next step is running on the GPU):
  4. incremental detokenisation and stop strings (engine/output/text.TextStream).
An engine built with detokenize=False (the server's engine core) skips step 4: its caller does it.
Prompt logprobs arrive per scored prompt chunk and are handed out once the prompt is complete
(`PromptLogprobs`). Forced tokens get mask 0 and are computed next step like any pending tokens. The
per-sample state is the sequence's SampleState (engine/sched/request.py). Fault injection is bound once
here: when it is off, no per-token code calls into the injector.
"""

from __future__ import annotations

from engine.core.faults import FaultInjector
from engine.output.calculator import evaluate, format_result
from engine.output.text import TextStream
from engine.outputs import TokenLogprob
from engine.sched.request import Request, Sequence
from engine.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        faults: FaultInjector,
        detokenize: bool = True,
    ):
        self.tokenizer = tokenizer
        self.detokenize_text = detokenize
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._fault = faults.checker()  # None when fault injection is off
        self._token_cache: dict[str, list[int]] = {}

    def _text(self, seq: Sequence) -> TextStream:
        st = seq.state
        if st.text is None:
            params = seq.request.params
            st.text = TextStream(
                self.tokenizer, seq.request.prompt_ids, params.stop, params.include_stop_str_in_output
            )
        return st.text

    def append(self, seq: Sequence, token: int, logprob) -> str | None:
        """Token-level work, done before the next step is scheduled: append the sampled token (or its
        forced replacement), check stop ids / EOS and length. Returns a finish reason or None."""
        params, st = seq.request.params, seq.state
        if self._fault is not None:
            self._fault("sample", seq.request)
        forced = self._budget_forcing(seq, token)
        if forced is not None:
            self._append(seq, forced, 0)
        else:
            self._append(seq, [token], 1, logprob)
            forced = self._tool(seq, token)
            if forced:
                self._append(seq, forced, 0)
        reason = None
        grammar = seq.grammar  # took the token already (TokenSink.receive); never forced: admission
        if grammar is not None:  # refuses both
            grammar.check()  # raises if the fill found a token the grammar refused (a bug)
        if forced is None and (
            token in params.stop_token_ids
            or (token in self.eos_token_ids and (not params.ignore_eos or grammar is not None))
        ):
            # EOS ends a grammar's sample even with ignore_eos: a complete grammar admits nothing else
            reason = "stop"
            st.ends_with_stop_token = True  # a stop token / EOS is never part of the text
        over = seq.num_output - params.max_tokens
        if over >= 0:
            if over > 0:  # forced tokens overshot the budget, or max_tokens is 0: keep exactly max_tokens
                self._trim(seq, over)
                reason = None  # a stop token can only be cut here when max_tokens is 0: it ends by length
            reason = reason or "length"
        if seq.num_tokens >= self.max_model_len:
            reason = reason or "length"
        return reason

    @staticmethod
    def _trim(seq: Sequence, over: int) -> None:
        """Drop the last `over` output tokens (and the logprobs of the sampled ones among them)."""
        st = seq.state
        del seq.token_ids[-over:], seq.masks[-over:], st.pending_ids[-over:], st.pending_masks[-over:]
        if st.pending_logprobs:  # one per sampled (mask 1) pending token
            del st.pending_logprobs[sum(st.pending_masks) :]
        st.ends_with_stop_token = False

    def detokenize(self, seq: Sequence) -> bool:
        """Text-level work, done while the GPU runs the next step: new text and stop strings.
        Returns True when a stop string ended the sample."""
        st, text = seq.state, self._text(seq)
        if self._fault is not None:
            self._fault("detokenize", seq.request)
        new = seq.token_ids[seq.num_prompt + st.num_seen :]
        st.num_seen = seq.num_output
        taken = text.push(new[:-1] if st.ends_with_stop_token and new else new)
        if seq.finished and taken is None:
            text.finish()
        return taken is not None and taken > 0

    # ------------------------------------------------------------------ forced tokens
    def _encode(self, text: str) -> list[int]:
        if text not in self._token_cache:
            self._token_cache[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._token_cache[text]

    def _budget_forcing(self, seq: Sequence, token: int) -> list[int] | None:
        bf = seq.request.params.budget_forcing
        if bf is None or seq.num_output >= bf.min_tokens:
            return None
        if token not in self._encode(bf.suppress)[:1]:
            return None
        count = seq.state.budget_forcings
        seq.state.budget_forcings = count + 1
        return self._encode(bf.replacements[count % len(bf.replacements)])

    def _tool(self, seq: Sequence, token: int) -> list[int] | None:
        tool = seq.request.params.tool
        if tool is None or [token] != self._encode(tool.python_end):
            return None
        if self._fault is not None:
            self._fault("tool", seq.request)
        # the expression runs from the last python-start marker (prompt or output) to this end marker
        ids = seq.token_ids
        (start_id,) = self._encode(tool.python_start)[:1] or [None]
        start = next((i for i in range(len(ids) - 2, -1, -1) if ids[i] == start_id), None)
        if start is None:
            return None
        value = evaluate(self.tokenizer.decode(ids[start + 1 : -1]))
        if value is None:
            return None
        return (
            self._encode(tool.output_start)
            + self._encode(format_result(value))
            + self._encode(tool.output_end)
        )

    def _append(self, seq: Sequence, tokens: list[int], mask: int, logprob=None) -> None:
        st = seq.state
        seq.token_ids += tokens
        seq.masks += [mask] * len(tokens)
        st.pending_ids += tokens
        st.pending_masks += [mask] * len(tokens)
        if logprob is not None:
            chosen, top = logprob
            st.pending_logprobs.append(TokenLogprob(tokens[0], chosen, top))

    def take_text(self, seq: Sequence, final: bool) -> str:
        """Text ready to emit ("" when the engine leaves text to its caller)."""
        return self._text(seq).take(final) if self.detokenize_text else ""


class PromptLogprobs:
    """Prompt logprobs (SamplingParams.prompt_logprobs) gathered over a request's prompt chunks and
    handed out once, when the chunk that completes the prompt has been scored. Entry i is the logprob
    of prompt token i given the tokens before it; entry 0 is None (nothing predicts the first token).
    A chunk recomputed before completion (preemption) overwrites its positions with the same values."""

    def __init__(self) -> None:
        self._partial: dict[Request, list[TokenLogprob | None]] = {}
        self.ready: dict[Request, list[TokenLogprob | None]] = {}  # complete, not handed out yet

    def absorb(self, scores: tuple) -> None:
        """One step's scores (SampleResult.prompt): spans of (sequence, first target position, count,
        completes the prompt) over rows of target logprobs and top-k ids / logprobs."""
        spans, chosen, top_ids, top_lp = scores
        row = 0
        for seq, first, count, completes in spans:
            request, start = seq.request, row
            row += count
            if request.aborted:
                continue  # aborted or failed while the step ran: nobody will take them
            ids, k = request.prompt_ids, request.params.prompt_logprobs
            entries = self._partial.setdefault(request, [None] * request.num_prompt)
            for i in range(start, row):
                pos = first + i - start
                entries[pos] = TokenLogprob(ids[pos], chosen[i], list(zip(top_ids[i][:k], top_lp[i][:k])))
            if completes:
                self.ready[request] = self._partial.pop(request)

    def drop(self, request: Request) -> None:
        """Forget a request that ended (its complete list, if any, went out with its outputs)."""
        self._partial.pop(request, None)
        self.ready.pop(request, None)

"""Turns sampled tokens into per-request outputs: forced tokens, stops, text deltas, finish reasons.

Token-level work (`append`, between two steps unless the next one was launched ahead), per sample:
  1. budget forcing: a sampled suppress token before the budget is spent becomes a replacement string;
  2. the calculator tool: a sampled python-end marker evaluates the expression since the last
     python-start marker and forces "<output_start> result <output_end>" into this sequence only;
  3. stop token ids / EOS, max_tokens and max_model_len;
Text-level work (`detokenize`, deferred until the next step is running on the GPU):
  4. incremental detokenisation, stop strings matched across token boundaries (the stop string is not
     emitted: text that could still begin a stop string is held back until it cannot).
Forced tokens get mask 0 and are computed next step like any pending tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.calculator import evaluate, format_result
from engine.detokenizer import IncrementalDetokenizer
from engine.faults import FaultInjector
from engine.outputs import TokenLogprob
from engine.request import Sequence
from engine.tokenizer import Tokenizer


@dataclass
class SampleState:
    """Per-sample streaming state; `pending_*` is what the next RequestOutput will carry."""

    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    num_seen: int = 0  # output tokens already detokenised
    pending_ids: list[int] = field(default_factory=list)
    pending_masks: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    stopped_by_string: bool = False
    ends_with_stop_token: bool = False


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int, faults: FaultInjector
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.faults = faults
        self._token_cache: dict[str, list[int]] = {}

    def state(self, seq: Sequence) -> SampleState:
        if "out" not in seq.state:
            seq.state["out"] = SampleState(IncrementalDetokenizer(self.tokenizer, seq.request.prompt_ids))
        return seq.state["out"]

    def append(self, seq: Sequence, token: int, logprob) -> str | None:
        """Token-level work, done before the next step is scheduled: append the sampled token (or its
        forced replacement), check stop ids / EOS and length. Returns a finish reason or None."""
        params, st = seq.request.params, self.state(seq)
        self.faults.check("sample", seq.request)
        forced = self._budget_forcing(seq, token)
        if forced is not None:
            self._append(seq, forced, 0)
        else:
            self._append(seq, [token], 1, logprob)
            forced = self._tool(seq, token)
            if forced:
                self._append(seq, forced, 0)
        reason = None
        if forced is None and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        ):
            reason = "stop"
            st.ends_with_stop_token = True  # a stop token / EOS is never part of the text
        over = seq.num_output - params.max_tokens
        if over >= 0:
            if over > 0:  # forced tokens overshot the budget: keep exactly max_tokens
                del seq.token_ids[-over:], seq.masks[-over:], st.pending_ids[-over:], st.pending_masks[-over:]
            reason = reason or "length"
        if seq.num_tokens >= self.max_model_len:
            reason = reason or "length"
        return reason

    def detokenize(self, seq: Sequence) -> bool:
        """Text-level work, done while the GPU runs the next step: new text and stop strings.
        Returns True when a stop string ended the sample."""
        st = self.state(seq)
        stopped = self._detokenize(seq, skip_last=st.ends_with_stop_token)
        if seq.finished or stopped:
            if not st.stopped_by_string:
                st.text += st.detok.flush()  # an incomplete character held back at the very end
        return stopped

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
        count = seq.state.get("bf_count", 0)
        seq.state["bf_count"] = count + 1
        return self._encode(bf.replacements[count % len(bf.replacements)])

    def _tool(self, seq: Sequence, token: int) -> list[int] | None:
        tool = seq.request.params.tool
        if tool is None or [token] != self._encode(tool.python_end):
            return None
        self.faults.check("tool", seq.request)
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
        st = self.state(seq)
        seq.token_ids += tokens
        seq.masks += [mask] * len(tokens)
        st.pending_ids += tokens
        st.pending_masks += [mask] * len(tokens)
        if logprob is not None:
            chosen, top = logprob
            st.pending_logprobs.append(TokenLogprob(tokens[0], chosen, top))

    # ------------------------------------------------------------------ text
    def _detokenize(self, seq: Sequence, skip_last: bool) -> bool:
        """Feed new output tokens to the detokenizer; True when a stop string was found."""
        st, stops = self.state(seq), seq.request.params.stop
        self.faults.check("detokenize", seq.request)
        new = seq.token_ids[seq.num_prompt + st.num_seen :]
        st.num_seen = seq.num_output
        if skip_last and new:
            new = new[:-1]
        for token in new:
            if st.stopped_by_string:
                break
            st.text += st.detok.push(token)
            if stops and self._cut_stop_string(seq, st):
                return True
        return False

    def _cut_stop_string(self, seq: Sequence, st: SampleState) -> bool:
        params = seq.request.params
        window = st.text[max(0, st.emitted - max(map(len, params.stop))) :]
        offset = len(st.text) - len(window)
        hits = [(window.find(s), s) for s in params.stop if s in window]
        if not hits:
            return False
        pos, s = min(hits)
        st.text = st.text[: offset + pos + (len(s) if params.include_stop_str_in_output else 0)]
        st.stopped_by_string = True
        return True

    def take_text(self, seq: Sequence, final: bool) -> str:
        """Text ready to emit: everything when final, else all but what could start a stop string."""
        st = self.state(seq)
        stops = seq.request.params.stop
        hold = 0 if final or not stops else max(map(len, stops)) - 1
        end = max(st.emitted, len(st.text) - hold)
        delta, st.emitted = st.text[st.emitted : end], end
        return delta

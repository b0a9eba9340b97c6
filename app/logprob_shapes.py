"""Logprobs in the shapes clients read, built from the engine replica's stream items (app/streaming.py).

* Completions (OpenAI's legacy shape): parallel lists `tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`. With echo the prompt's tokens come first; its first token has nothing before it to
  score it, so its logprob and its top_logprobs are null. `text_offset` is each token's character
  offset in the returned text (the prompt as sent, then the completion); a BOS the tokenizer added
  appears in `tokens` at offset 0 with no width in the text. `top_logprobs` holds the top k and, as
  OpenAI's reference says, the chosen token too.
* Chat: `content` entries {token, logprob, bytes, top_logprobs}.
* vLLM's `prompt_logprobs`: a list with null first, then per prompt position a dict
  {token id as a string: {"logprob", "rank", "decoded_token"}} holding the prompt token and the top k.
  The engine reports the top k and the prompt token's logprob, so the prompt token's rank is known
  when it is among the top k (its place there) and null otherwise (it is then below k).
"""

from __future__ import annotations

from app.responses import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs


def chat_logprobs(entries: list[dict]) -> ChatLogprobs:
    def top(token: str, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e["token"],
                logprob=e["logprob"],
                bytes=list(e["token"].encode("utf-8")),
                top_logprobs=[top(t, v) for t, v in e["top"]],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[dict], offset: int) -> tuple[CompletionLogprobs, int]:
    """Generated tokens' logprobs, offsets counted on from `offset`; returns the offset after them."""
    lp = CompletionLogprobs()
    for e in entries:
        top = dict(e["top"])
        top.setdefault(e["token"], e["logprob"])
        lp.tokens.append(e["token"])
        lp.token_logprobs.append(e["logprob"])
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(e["token"])
    return lp, offset


def echo_logprobs(
    texts: list[str], offsets: list[int], prompt_lp: list[dict | None] | None
) -> CompletionLogprobs:
    """The prompt's part of the legacy shape: `texts` are the prompt tokens' texts, every prompt token
    (a BOS the tokenizer added included, so that there is one entry per prompt token, as lm-eval counts
    them); `offsets` their places in the echoed prompt (app/prompts.token_offsets); `prompt_lp` the
    item's prompt logprobs (app/streaming)."""
    lp = CompletionLogprobs(tokens=list(texts), text_offset=list(offsets))
    for i in range(len(texts)):
        e = prompt_lp[i] if prompt_lp is not None and i < len(prompt_lp) else None
        if e is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            top = {t: v for _, t, v in e["top"]}
            top.setdefault(e["token"], e["logprob"])
            lp.token_logprobs.append(e["logprob"])
            lp.top_logprobs.append(top)
    return lp


def join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def vllm_prompt_logprobs(prompt_lp: list[dict | None]) -> list[dict | None]:
    out: list[dict | None] = []
    for e in prompt_lp:
        if e is None:
            out.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _, _) in enumerate(e["top"])}
        position = {
            str(e["token_id"]): {
                "logprob": e["logprob"],
                "rank": ranks.get(e["token_id"]),
                "decoded_token": e["token"],
            }
        }
        for t, text, v in e["top"]:
            position.setdefault(str(t), {"logprob": v, "rank": ranks[t], "decoded_token": text})
        out.append(position)
    return out

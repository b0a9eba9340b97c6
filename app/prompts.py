"""Prompt work done in the engine replica, which holds the tokenizer: chat rendering, echo, /tokenize.

`prepare` turns what the ingress sent into what the engine takes, and says what the ingress needs to
know about the prompt (in the "accepted" stream item): chat prompts are rendered here with their
template options and sent to the engine as token ids; echo needs the prompt's text as sent, its token
ids, each token's text and each token's offset in that text. Plain requests pass through untouched,
so they pay for nothing of this.
"""

from __future__ import annotations

from collections.abc import Callable

from app.chat import ChatPrompt
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams


def token_texts(decode: Callable[[list[int]], str], ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces concatenate to decode(ids) exactly.

    A token that ends inside a multi-byte character adds "" and the token that completes it adds the
    character. Each piece is decoded with the token before it as context (the difference of two short
    decodes), as incremental detokenizers do, so a tokenizer that drops a leading space of the first
    token in a decode still gives every later token its space. Two short decodes per token."""
    texts: list[str] = []
    prefix = read = 0  # ids[prefix:read]: context already emitted; ids[read:] not yet emitted
    for i in range(len(ids)):
        before = decode(ids[prefix:read])
        now = decode(ids[prefix : i + 1])
        if now.endswith("\ufffd") and i + 1 < len(ids):  # an incomplete character: wait for more bytes
            texts.append("")
            continue
        texts.append(now[len(before) :])
        prefix, read = read, i + 1
    return texts


def token_offsets(texts: list[str], text: str, special: list[bool]) -> list[int]:
    """Each token's character offset in `text`, the echoed prompt (OpenAI's text_offset).

    Tokens are matched in order: one whose text is at the cursor takes its width there; a special token
    that the text does not hold there (the BOS a tokenizer adds to a string prompt) sits at the cursor
    with no width; any other token moves the cursor by its length (capped at the text's end), so the
    offsets never decrease even where a tokenizer does not round-trip the text."""
    offsets, cursor = [], 0
    for piece, is_special in zip(texts, special, strict=True):
        offsets.append(cursor)
        if text.startswith(piece, cursor) or not is_special:
            cursor = min(cursor + len(piece), len(text))
    return offsets


def _check_ids(ids: list[int], vocab_size: int, field: str) -> None:
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(
            f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", field
        )


def prepare(tokenizer, prompt, echo: bool, prompt_ids: bool = False) -> tuple[object, dict]:
    """(prompt for CoreClient.submit, facts for the ingress). Raises InvalidRequestError.
    prompt_ids: the facts carry the prompt's token ids (return_token_ids)."""
    facts: dict = {}
    if isinstance(prompt, ChatPrompt):
        ids, facts["starts_in_think"] = prompt.encode(tokenizer)
        facts["prompt_tokens"] = len(ids)
        prompt = ids
    if echo:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        _check_ids(ids, tokenizer.vocab_size, "prompt")  # before decoding them
        texts = token_texts(tokenizer.decode, ids)
        # the prompt as sent (OpenAI's and vLLM's echo); token ids echo as the text they decode to
        text = prompt if isinstance(prompt, str) else "".join(texts)
        special = [t in tokenizer.all_special_ids for t in ids]
        facts["prompt_text"] = text
        facts["prompt_token_texts"] = texts
        facts["prompt_token_offsets"] = token_offsets(texts, text, special)
        facts["prompt_tokens"] = len(ids)
        prompt = ids
    if prompt_ids:
        prompt = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        facts["prompt_token_ids"] = prompt
    return prompt, facts


def prompt_too_long(
    exc: PromptTooLongError, tokenizer, prompt, params: SamplingParams, limits, chat: bool
) -> PromptTooLongError:
    """The engine's error, or, when the prompt alone leaves no room for one token, an error against the
    prompt (`messages` for chat): lowering max_tokens cannot help then. Only runs on the error path."""
    n = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
    need = n + min(1, params.max_tokens)
    blocks = -(-need // limits.block_size)
    if need <= limits.max_model_len and blocks <= limits.num_blocks:
        return exc
    field = "messages" if chat else "prompt"
    room = min(limits.max_model_len, limits.num_blocks * limits.block_size)
    return PromptTooLongError(
        f"{field}: the prompt is {n} tokens and the context holds {room} (prompt plus completion): "
        "shorten the prompt",
        field,
    )


def tokenize(
    tokenizer, source: str | ChatPrompt, add_special_tokens: bool | None, max_model_len: int
) -> dict:
    """vLLM's /tokenize answer. A text prompt gets the tokenizer's special tokens (BOS) unless
    add_special_tokens is false; chat messages are rendered, and the template writes its own."""
    if isinstance(source, ChatPrompt):
        text = source.render(tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
    else:
        ids = tokenizer.encode(source, add_special_tokens=add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(tokenizer, tokens: list[int]) -> dict:
    _check_ids(tokens, tokenizer.vocab_size, "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info: what a client needs to rebuild the tokenizer's behaviour remotely (its
    class, special tokens, the chat template this server renders with, lengths). Only JSON values."""
    hf = tokenizer.hf
    info: dict = {"tokenizer_class": type(hf).__name__}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(hf, key, None)
        info[key] = value if isinstance(value, str) else None
    for key in ("padding_side", "truncation_side"):
        value = getattr(hf, key, None)
        if isinstance(value, str):
            info[key] = value
    # what encoding a text does, not the tokenizer_config flag (a tokenizer.json post-processor can add
    # BOS while add_bos_token says false)
    probe = tokenizer.encode("a")
    info["add_bos_token"] = bool(probe) and probe[0] == tokenizer.bos_token_id
    info["add_eos_token"] = bool(probe) and probe[-1] in tokenizer.eos_token_ids
    info["chat_template"] = tokenizer.chat_template_source
    info["model_max_length"] = max_model_len
    info["vocab_size"] = tokenizer.vocab_size
    info["eos_token_ids"] = sorted(tokenizer.eos_token_ids)
    return info

"""Chat prompts: what the ingress asks the engine replica to render with the model's chat template.

`ChatPrompt` is plain data (picklable), built from the request by the ingress and rendered in the engine
replica, which holds the tokenizer (`encode`): the template's text is encoded without adding special
tokens (the template writes its own BOS), and the token ids go to the engine. The replica also reports
whether the prompt leaves the model inside a `<think>` block (templates of thinking models may open it
in the generation prompt), so the reasoning split (app/reasoning.py) starts in the right state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools"})


@dataclass
class ChatPrompt:
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None  # OpenAI function definitions: the template's `tools` variable

    def __post_init__(self) -> None:
        clash = sorted(RESERVED_KWARGS & set(self.template_kwargs))
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs: {clash[0]!r} is a request field, not a template variable: set it "
                "at the top level of the request",
                "chat_template_kwargs",
            )

    def render(self, tokenizer) -> str:
        """The template's text (raises InvalidRequestError naming `messages` when the template refuses)."""
        return tokenizer.render_chat(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            **self.template_kwargs,
            **({"tools": self.tools} if self.tools is not None else {}),
        )

    def encode(self, tokenizer) -> tuple[list[int], bool]:
        """(prompt token ids, whether generation starts inside a <think> block)."""
        text = self.render(tokenizer)
        return tokenizer.encode(text, add_special_tokens=False), self.starts_in_think(text)

    def starts_in_think(self, text: str) -> bool:
        """A generation prompt that ends with an open `<think>` (Qwen 3 thinking variants, DeepSeek R1),
        or a continued assistant message whose last `<think>` is not closed: the output is reasoning
        until `</think>`. Only the end of the prompt counts: a user who writes "<think>" changes nothing."""
        if self.continue_final_message:
            content = self.messages[-1]["content"]
            return content.rfind(THINK_OPEN) > content.rfind(THINK_CLOSE)
        return self.add_generation_prompt and text.rstrip().endswith(THINK_OPEN)

"""The routing key of a request: the chain hashes of its prompt's leading KV blocks (app/router.py).

Computed in the ingress, before the engine call is routed, exactly as the engine's prefix cache will
hash the prompt: the same tokenizer and chat template (app/chat.ChatPrompt.encode, engine/admission
.tokenize) and the same hash chain (engine.prompt_block_hashes), which starts from the request's
adapter. The engine replica tokenizes the prompt again for itself; that second pass costs the ingress
nothing and keeps one path for prompts.
"""

from __future__ import annotations

from app.chat import ChatPrompt
from engine import LoRARequest, Tokenizer, prompt_block_hashes


class PrefixKeys:
    """prompt (text, token ids or ChatPrompt) -> its leading block hashes; [] when it cannot tell (a
    prompt the engine will refuse gets its error there, not here)."""

    def __init__(self, model_dir: str, block_size: int, max_blocks: int = 256):
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.block_size, self.max_blocks = block_size, max_blocks

    def __call__(self, prompt: str | list[int] | ChatPrompt, lora: LoRARequest | None = None) -> list[int]:
        """lora: the request's adapter (None: the base model); the engine keys an adapter's blocks by it,
        so the same prompt under two adapters has two keys."""
        try:
            if isinstance(prompt, ChatPrompt):
                ids = prompt.encode(self.tokenizer)[0]
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                ids = prompt
            adapter = {"lora_request": lora} if lora is not None else {}
            return prompt_block_hashes(ids, self.block_size, self.max_blocks, **adapter)
        except Exception:  # e.g. a template error: the engine replica reports it properly
            return []

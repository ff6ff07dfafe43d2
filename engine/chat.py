"""Chat turns: a conversation (``[{"role": ..., "content": ...}, ...]``) formatted with the
model's own chat template, as a chat client would send it to a server."""

from __future__ import annotations


class ChatError(ValueError):
    """The model cannot chat, or the messages are malformed (one-line message)."""


def is_messages(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` formatted by the chat template, ending with the generation
    prompt of the assistant's turn. The template writes any BOS token itself."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatError("this model has no chat template (SmolLM2-135M-Instruct has one)")
    for m in messages:
        if set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
            raise ChatError(f"a chat message needs exactly a string role and content: {m!r}"[:200])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)

"""Messages → the exact token ids the model sees.

With a chat template, messages are rendered by the template and tokenized without adding
special tokens: the template writes its own BOS, and letting the tokenizer add one more would
give the model a double BOS it never saw in training. Without a template the prompt is plain
text: the system text, a blank line, then the user text, tokenized as a plain string would be.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, str]


def build_messages(user_text: str, system: str | None = None) -> list[Message]:
    messages: list[Message] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    return messages


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True) -> str:
    """The template's text for these messages. Templates that refuse a system role (Gemma's,
    Mistral's older ones) get the system text folded into the first user message instead."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except TemplateError:
        if not messages or messages[0]["role"] != "system" or len(messages) < 2:
            raise
        system, first, *rest = messages
        merged = {"role": first["role"], "content": f"{system['content']}\n\n{first['content']}"}
        return tokenizer.apply_chat_template(
            [merged, *rest], add_generation_prompt=add_generation_prompt, tokenize=False
        )


def prompt_ids(tokenizer: Any, messages: list[Message], *, raw: bool = False) -> list[int]:
    """Token ids for a one-shot prompt: the chat template when the model has one, unless `raw`."""
    if raw or not getattr(tokenizer, "chat_template", None):
        text = "\n\n".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    text = render_chat(tokenizer, messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

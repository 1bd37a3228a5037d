"""Messages and the exact token ids the model sees for them.

One-shot prompts (`prompt_ids`): with a chat template, messages are rendered by the template and
tokenized without adding special tokens (the template writes its own BOS; letting the tokenizer
add one more would give the model a double BOS). Without a template the prompt is plain text.

Chats (`Conversation`) keep the token sequence the model actually saw, generated tokens
included: re-tokenizing a reply's text does not give back the tokens the model sampled (the
tokenizer may split the same text differently), so a chat that re-rendered everything each turn
would lose its cache after the first reply. Each turn instead renders the whole chat as text,
keeps the longest prefix of the held ids whose text the rendering starts with, and tokenizes only
the rest. Usually that rest is just the new message and its framing. When the template rewrites
earlier turns (Qwen3-style templates drop old <think> blocks; others trim whitespace), the kept
prefix ends where the rewrite starts, and the engine re-prefills from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmcli.engine.control_text import Prompt, guard_of, mark, parse
from llmcli.engine.detok import decode_exact
from llmcli.engine.prompt_bounds import refuse_unfittable
from llmcli.engine.prompt_images import (
    encode_with_images,
    expanded,
    held_text,
    images_held,
    images_in,
    refuse_images,
    whole_images,
)
from llmcli.engine.reasoning import closing_text, opens_thinking, thinking_of
from llmcli.errors import ContextOverflowError, LlmcliError

if TYPE_CHECKING:
    from llmcli.engine.image_rows import ImageTable
    from llmcli.engine.tools import ToolRequest
    from llmcli.models.vision.encoder import ImageInput

Message = dict[str, Any]

# The chat format for models without a chat template: plain labelled turns. The reply is cut at
# the next "\nUser:" so a base model does not go on to write the user's side too.
PLAIN_ROLES = {"system": "", "user": "User: ", "assistant": "Assistant: "}
PLAIN_STOP = "\nUser:"
TEMPLATE_HINT = "a chat template is code from the model's publisher; --raw sends text without it"


def build_messages(user_text: str, system: str | None = None) -> list[Message]:
    messages: list[Message] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    return messages


TEMPLATE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _template_view(messages: list[Message]) -> list[dict[str, Any]]:
    """Only what templates know about: our own keys (e.g. "interrupted") stay out, and so do
    keys whose value is None (templates test for a key, and would write "None"). An image part
    reaches the template as {"type": "image"}: where it goes, never its bytes."""
    return [
        {
            key: _parts_view(m[key]) if key == "content" else m[key]
            for key in TEMPLATE_KEYS
            if m.get(key) is not None
        }
        for m in messages
    ]


def _parts_view(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return [{"type": "image"} if part.get("type") == "image" else part for part in content]


def render_chat(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True, **options: Any
) -> str:
    """The template's text for these messages, rendered in a bounded sandbox (`templates`).
    Templates that refuse a system role (Gemma's, Mistral's older ones) get the system text
    folded into the first user message instead."""
    from jinja2.exceptions import TemplateError

    from llmcli.engine.templates import TemplateLimitError, render_template

    source = tokenizer.get_chat_template(tools=options.get("tools"))
    context = {"tools": None, "documents": None, **tokenizer.special_tokens_map, **options}
    view = _template_view(messages)
    context["add_generation_prompt"] = add_generation_prompt
    try:
        try:
            return render_template(source, messages=view, **context)
        except TemplateLimitError:
            raise
        except TemplateError:
            if not view or view[0]["role"] != "system" or len(view) < 2:
                raise
            system, first, *rest = view
            merged = {**first, "content": _folded(system["content"], first["content"])}
            return render_template(source, messages=[merged, *rest], **context)
    except TemplateLimitError as error:
        raise LlmcliError(f"the model's chat template was stopped: {error}", TEMPLATE_HINT) from None
    except TemplateError as error:  # e.g. roles that do not alternate, for a strict template
        raise LlmcliError(f"the model's chat template refused these messages: {error}") from None
    except (TypeError, AttributeError, KeyError, ValueError) as error:  # Python's, inside the template
        if any(isinstance(m.get("content"), list) for m in view):
            raise LlmcliError("the model's chat template reads text only: it cannot place an image") from None
        raise LlmcliError(f"the model's chat template failed on these messages: {error}") from None


def _folded(system: str, content: Any) -> Any:
    """A system prompt folded into the first user message, its text or its parts."""
    if isinstance(content, list):
        return [{"type": "text", "text": f"{system}\n\n"}, *content]
    return f"{system}\n\n{content}"


def render_plain(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True) -> str:
    """The fallback chat format: "<bos>{system}\\n\\nUser: …\\nAssistant: …\\n"."""
    parts = [tokenizer.bos_token or ""]
    for message in messages:
        if message["role"] == "system":
            parts.append(f"{message['content']}\n\n")
        else:
            parts.append(f"{PLAIN_ROLES.get(message['role'], message['role'] + ': ')}{message['content']}\n")
    if add_generation_prompt:
        parts.append(PLAIN_ROLES["assistant"].rstrip())
    return "".join(parts)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    think_off: bool = False,
    options: dict[str, Any] | None = None,
) -> str:
    """The prompt as text. `think_off`: a reasoning model answers without thinking, through its
    template's `enable_thinking` switch where it reads one, else by closing the think block."""
    return render_prompt(tokenizer, messages, add_generation_prompt, think_off, options).text


def render_prompt(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    think_off: bool = False,
    options: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> Prompt:
    """The prompt, with the control tokens' text that the messages (or tools) carry kept apart
    from the template's markup, so that it is encoded as text (see `control_text`).
    `continue_final`: the last message is the assistant's, left open for the reply to go on
    (a prefill), not closed and answered afresh."""
    guard = guard_of(tokenizer)
    messages = mark(messages, guard)
    add_generation_prompt = add_generation_prompt and not continue_final
    if not has_chat_template(tokenizer):
        text = render_plain(tokenizer, messages, add_generation_prompt)
        return parse(_left_open(text, messages[-1]) if continue_final else text, guard)
    thinking = thinking_of(tokenizer) if think_off else None
    options = mark(dict(options or {}), guard)  # the template's own keywords (chat_template_kwargs)
    if thinking and thinking.switchable:
        options["enable_thinking"] = False
    text = render_chat(tokenizer, messages, add_generation_prompt, **options)
    if continue_final:
        return parse(_left_open(text, messages[-1]), guard)
    if (
        thinking
        and add_generation_prompt
        and (not thinking.switchable or opens_thinking(text, thinking.format))
    ):
        text += closing_text(text, thinking.format)
    return parse(text, guard)


def _left_open(rendered: str, final: Message) -> str:
    """The rendering cut right after the final message's text, as transformers'
    `continue_final_message` cuts it: the markup that closes the message goes."""
    content = _text_of(final)
    at = rendered.rfind(content) if content else -1
    if at < 0:
        raise LlmcliError(
            "the model's chat template rewrites the final assistant message, so it cannot be continued"
        )
    return rendered[: at + len(content)]


def prompt_ids(
    tokenizer: Any,
    messages: list[Message],
    *,
    raw: bool = False,
    think_off: bool = False,
    options: dict[str, Any] | None = None,
    context_length: int | None = None,
    continue_final: bool = False,
    images: ImageTable | None = None,
) -> list[int]:
    """Token ids for a one-shot prompt: the chat template when the model has one, unless `raw`.
    Only `raw` lets the text's `<|…|>` become control tokens. With `context_length`, text that
    cannot fit is refused before it is tokenized. `continue_final`: see `render_prompt` (plain
    text ends with the last message anyway). `images`: the model's table of images, where it
    reads them (image parts in the messages are placed by its template: prompt_images.py)."""
    if context_length is not None:
        refuse_unfittable(tokenizer, [_text_of(m) for m in messages], context_length)
    if raw or not has_chat_template(tokenizer):
        refuse_images(
            messages, "an image needs the model's chat template to place it (--raw sends text only)"
        )
    if raw:
        text = "\n\n".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not has_chat_template(tokenizer):
        guard = guard_of(tokenizer)
        prompt = parse("\n\n".join(mark(m["content"], guard) for m in messages), guard)
        if len(prompt.pieces) == 1:
            return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
        head, tail = _added_around(tokenizer)
        return head + prompt.encode(tokenizer) + tail
    prompt = render_prompt(
        tokenizer, messages, think_off=think_off, options=options, continue_final=continue_final
    )
    given = images_in(messages)
    prompt = expanded(tokenizer, prompt, given, images)
    return encode_with_images(tokenizer, prompt, given, images, context_length=context_length)


def _text_of(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):  # text and image parts: the text
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else str(content or "")


def _added_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (a BOS, say) when asked to."""
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return full[:at], full[at + len(bare) :]
    return [], []


def ids_for_text(
    tokenizer: Any,
    held: list[int],
    prompt: Prompt | str,
    images: list[ImageInput] | None = None,
    table: ImageTable | None = None,
) -> list[int]:
    """Token ids for `text` that keep the longest prefix of `held` whose text `text` starts with.

    The held ids are what the model saw (its own sampled tokens included), so they are kept
    as they are; only the remainder of `text` is tokenized. A binary search finds the prefix,
    so a long chat costs a few decodes, not one per token. `images`: those of the messages
    rendered, in order; an image held reads as its marker (prompt_images.held_text), so a chat
    keeps it, and only the images after the prefix are placed anew.
    """
    if isinstance(prompt, str):
        prompt = Prompt(((prompt, False),))
    images = images or []
    prompt = expanded(tokenizer, prompt, images, table)
    text = prompt.text

    def read(ids: list[int]) -> str:
        return held_text(tokenizer, ids, table, decode_exact)

    low, high = 0, len(held)  # read(held[:low]) is a prefix of text; find the largest such
    if text.startswith(read(held)):
        low = high
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(read(held[:middle])):
            low = middle
        else:
            high = middle - 1
    low = whole_images(held, low, table)  # never a part of an image: all its rows, or none
    covered = len(read(held[:low]))
    rest = encode_with_images(tokenizer, prompt, images, table, covered, images_held(held[:low]))
    return held[:low] + rest


def exchange_starts(messages: list[Message]) -> list[int]:
    """Where each exchange of a chat begins: at its user message (tool calls and results come
    between it and the reply); the first begins at the start, whatever a loaded chat starts with."""
    later = [i for i, message in enumerate(messages) if message["role"] == "user" and i > 0]
    return [0, *later] if messages else []


@dataclass
class Exchange:
    """What one turn added, for /undo and /retry."""

    user: str | list[dict[str, Any]]  # the message's text, or its text and images
    reply: str
    finish_reason: str


@dataclass
class Conversation:
    """A chat: its messages and the exact token ids the model has seen for them.

    No terminal code and no tensors: the engine owns the cache, and reuses whatever prefix of
    `ids` it still holds.
    """

    tokenizer: Any
    context_length: int
    system: str | None = None
    messages: list[Message] = field(default_factory=list)  # exchanges: user, [calls, results], reply
    ids: list[int] = field(default_factory=list)
    think_off: bool = False  # a reasoning model answers without thinking (chat --think off)
    tools: ToolRequest | None = None  # tools the replies may call (chat --functions)
    # The model's table of images (image_rows.py), where its messages may hold images: an image
    # held reads as its marker, so a later turn keeps it cached, never encodes it again.
    images: ImageTable | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if has_chat_template(self.tokenizer) else (PLAIN_STOP,)

    def _all_messages(self, extra: list[Message] | None = None) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + (extra or [])

    def _render_ids(self, messages: list[Message], add_generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        options = None
        if self.tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages):
            from llmcli.engine.tools.formats import template_messages, tool_format_of

            messages, options = template_messages(messages, self.tools, tool_format_of(self.tokenizer))
        prompt = render_prompt(
            self.tokenizer, messages, add_generation_prompt, self.think_off and add_generation_prompt, options
        )
        return ids_for_text(self.tokenizer, self.ids, prompt, images_in(messages), self.images)

    def exchange_starts(self) -> list[int]:
        return exchange_starts(self.messages)

    def prompt_for(
        self, user_text: str | list[dict[str, Any]], reply_room: int, steps: list[Message] | None = None
    ) -> tuple[list[int], int]:
        """Prompt ids for a new user message (and the tool calls and results of this turn so
        far, `steps`), and how many oldest exchanges had to be dropped.

        Nothing changes here: the caller commits the turn only once it has a reply. The prompt
        plus `reply_room` tokens must fit in the context; the oldest exchanges go first, the
        system prompt always stays.
        """
        user_words = _text_of({"content": user_text})
        refuse_unfittable(
            self.tokenizer, [user_words, *(_text_of(m) for m in steps or [])], self.context_length
        )
        user = {"role": "user", "content": user_text}
        starts = [*self.exchange_starts(), len(self.messages)]
        for dropped in range(0, len(starts)):
            kept = self.messages[starts[dropped] :]
            head = [{"role": "system", "content": self.system}] if self.system else []
            ids = self._render_ids([*head, *kept, user, *(steps or [])], add_generation_prompt=True)
            if len(ids) + reply_room <= self.context_length:
                return ids, dropped
        raise ContextOverflowError(
            f"this message needs {len(ids)} tokens with the system prompt, plus {reply_room} for the reply; "
            f"the context holds {self.context_length}",
            "shorten the message, or lower max_new_tokens with /set",
        )

    def commit(
        self,
        user_text: str | list[dict[str, Any]],
        prompt: list[int],
        dropped: int,
        reply: str,
        reply_ids: list[int],
        finish_reason: str,
        steps: list[Message] | None = None,
    ) -> None:
        """Record a finished (or interrupted) turn: its messages and the exact ids of both
        (`prompt` holds the turn's tool calls and results, `steps`, already)."""
        starts = [*self.exchange_starts(), len(self.messages)]
        del self.messages[: starts[dropped]]
        self.messages.append({"role": "user", "content": user_text})
        self.messages.extend(steps or [])
        assistant: Message = {"role": "assistant", "content": reply}
        if finish_reason in ("interrupted", "error"):  # cut: by Ctrl-C, or a server that stopped
            assistant["interrupted"] = True
        self.messages.append(assistant)
        self.ids = prompt + reply_ids

    def last_exchange(self) -> Exchange | None:
        starts = self.exchange_starts()
        if not starts or starts[-1] == len(self.messages) - 1:
            return None
        user, assistant = self.messages[starts[-1]], self.messages[-1]
        finish = "interrupted" if assistant.get("interrupted") else "stop"
        return Exchange(user=user["content"], reply=assistant["content"], finish_reason=finish)

    def undo(self) -> Exchange | None:
        """Drop the last exchange; the ids go back to what the remaining messages render to."""
        last = self.last_exchange()
        if last is not None:
            del self.messages[self.exchange_starts()[-1] :]
            self.ids = self._render_ids(self._all_messages(), add_generation_prompt=False)
        return last

    def reset(self) -> None:
        self.messages.clear()
        self.ids = []

    def set_system(self, text: str | None) -> None:
        """A new system prompt: earlier turns stay; the engine re-prefills from the first change."""
        self.system = text or None
        self.ids = self._render_ids(self._all_messages(), add_generation_prompt=False)

    def history_ids(self) -> list[int]:
        """The ids of the whole chat as it stands (what a loaded chat prefills)."""
        return self._render_ids(self._all_messages(), add_generation_prompt=False)

"""Images in a rendered prompt: the chat template writes the model's image marker where a
message holds an image ({"type": "image"} parts); each marker becomes the image's placeholder
text, as its processor expands it, tokenized with the markup around it (control_text.py), and
its image tokens become the rows' markers (image_rows.py), which the native backend looks up.

Only the template's markup places an image: a user who types `<start_of_image>` gets the text
(control_text marks it), never an image slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmcli.engine.control_text import Prompt
from llmcli.engine.image_markers import split
from llmcli.errors import LlmcliError
from llmcli.models.vision.encoder import ImageInput

if TYPE_CHECKING:
    from llmcli.engine.image_rows import ImageTable


def images_in(messages: Sequence[dict[str, Any]]) -> list[ImageInput]:
    """The images of `messages`, in order (a message's content: text, or a list of text and
    image parts)."""
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            found += [
                part["image"] for part in content if isinstance(part, dict) and part.get("type") == "image"
            ]
    return found


def refuse_images(messages: Sequence[dict[str, Any]], why: str) -> None:
    """One line naming the first image, where images cannot be read (`why`)."""
    images = images_in(messages)
    if images:
        raise LlmcliError(f"image {images[0].label}: {why}")


def marker_spans(prompt: Prompt, marker: str) -> list[tuple[int, int]]:
    """Where the template's markup (never a user's text) writes `marker`: (start, end) offsets
    in the prompt's text."""
    spans, at = [], 0
    for piece, as_text in prompt.pieces:
        if not as_text:
            found = piece.find(marker)
            while found >= 0:
                spans.append((at + found, at + found + len(marker)))
                found = piece.find(marker, found + len(marker))
        at += len(piece)
    return spans


def expanded(tokenizer: Any, prompt: Prompt, images: list[ImageInput], table: ImageTable | None) -> Prompt:
    """The prompt with each image marker the template wrote replaced by its image's placeholder
    text (image_rows.py), the images taken in order: the text the model's processor tokenizes."""
    if not images:
        return prompt
    if table is None:
        raise LlmcliError(f"image {images[0].label}: this model reads text only")
    spans = marker_spans(prompt, table.template_text)
    if len(spans) != len(images):
        raise LlmcliError(
            f"image {images[min(len(spans), len(images) - 1)].label}: the chat template placed "
            f"{len(spans)} of {len(images)} images (it may take fewer, or none in this role)"
        )
    texts = iter(table.expand(image, tokenizer) for image in images)
    pieces, at = [], 0
    for piece, as_text in prompt.pieces:
        inside = [(begin - at, end - at) for begin, end in spans if at <= begin < at + len(piece)]
        cut = 0
        for begin, end in inside:
            pieces += [(piece[cut:begin], False), (next(texts), False)]
            cut = end
        pieces.append((piece[cut:], as_text))
        at += len(piece)
    # Markup stays one piece with the placeholders in it: tokenized whole, as the processor
    # tokenizes the expanded text (Gemma 3's blank lines merge with the newline before them).
    joined: list[tuple[str, bool]] = []
    for text, as_text in pieces:
        if joined and not as_text and not joined[-1][1]:
            joined[-1] = (joined[-1][0] + text, False)
        elif text:
            joined.append((text, as_text))
    return Prompt(tuple(joined))


def encode_with_images(
    tokenizer: Any,
    prompt: Prompt,
    images: list[ImageInput],
    table: ImageTable | None,
    start: int = 0,
    held: int = 0,
    context_length: int | None = None,
) -> list[int]:
    """Token ids for an `expanded` prompt's text from `start` (a character offset; 0: all of
    it), its image tokens replaced by the rows' markers of `images` after the first `held`
    (those a chat holds already, before `start`)."""
    ids = prompt.encode(tokenizer, start)
    if not images:
        return ids
    assert table is not None  # `expanded` refused a text-only model
    ids = table.mark(ids, images[held:], tokenizer)
    if context_length is not None and len(ids) > context_length:
        names = ", ".join(image.label for image in images)
        raise LlmcliError(
            f"the prompt with its {'image' if len(images) == 1 else 'images'} ({names}) needs {len(ids)} "
            f"tokens, and the context holds {context_length}",
            "send a smaller image, or fewer",
        )
    return ids


def whole_images(ids: Sequence[int], at: int, table: ImageTable | None) -> int:
    """`at`, or less: where a cut of `ids` keeps every image it holds whole (all its rows), the
    start of the one it would cut."""
    if table is None:
        return at
    last = next((index for index in range(at - 1, -1, -1) if ids[index] < 0), None)
    if last is None:
        return at
    number = split(ids[last])[0]
    first = next((i for i in range(last, -1, -1) if ids[i] < 0 and split(ids[i]) == (number, 0)), last)
    rows = sum(1 for token in ids[first:at] if token < 0 and split(token)[0] == number)
    return at if rows == table.rows_of(ids[last]) else first


def images_held(ids: Sequence[int]) -> int:
    """How many images `ids` hold (each image's first row; the same image twice is two)."""
    return sum(1 for token in ids if token < 0 and split(token)[1] == 0)


def held_text(tokenizer: Any, held: Sequence[int], table: ImageTable | None, decode: Any) -> str:
    """The text `held` ids read as, each image row as its image token's text (what an expanded
    rendering of the same chat writes there): `decode` decodes the runs of tokens."""
    if table is None or not any(token < 0 for token in held):
        return decode(tokenizer, list(held))
    parts, run = [], []
    for token in held:
        if token >= 0:
            run.append(token)
            continue
        if run:
            parts.append(decode(tokenizer, run))
            run = []
        parts.append(table.text_of(token))
    if run:
        parts.append(decode(tokenizer, run))
    return "".join(parts)

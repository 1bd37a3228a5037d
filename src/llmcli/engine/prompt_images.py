"""Images in a rendered prompt: the chat template writes the model's image marker where a
message holds an image ({"type": "image"} parts); each marker becomes the image's placeholder
(engine/image_rows.py: markers the native backend looks up), the text around them is encoded as
any prompt's (control_text.py).

Only the template's markup places an image: a user who types `<start_of_image>` gets the text
(control_text marks it), never an image slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmcli.engine.control_text import Prompt
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


def _cut(prompt: Prompt, end: int) -> Prompt:
    """The prompt's first `end` characters, in its pieces."""
    pieces, at = [], 0
    for piece, as_text in prompt.pieces:
        if at >= end:
            break
        pieces.append((piece[: end - at], as_text))
        at += len(piece)
    return Prompt(tuple(pieces))


def encode_with_images(
    tokenizer: Any,
    prompt: Prompt,
    images: list[ImageInput],
    table: ImageTable | None,
    start: int = 0,
    context_length: int | None = None,
) -> list[int]:
    """Token ids for the prompt's text from `start` (a character offset; 0: all of it), each
    image marker the template wrote replaced by its image's placeholder, the images taken in
    order. The images before `start` are those already held (a chat's earlier turns)."""
    if not images:
        return prompt.encode(tokenizer, start)
    if table is None:
        raise LlmcliError(f"image {images[0].label}: this model reads text only")
    spans = marker_spans(prompt, table.template_text)
    if len(spans) != len(images):
        raise LlmcliError(
            f"image {images[min(len(spans), len(images) - 1)].label}: the chat template placed "
            f"{len(spans)} of {len(images)} images (it may take fewer, or none in this role)"
        )
    ids: list[int] = []
    at = start
    for (begin, end), image in zip(spans, images, strict=True):
        if end <= start:
            continue
        if begin < start:  # the held ids end inside the marker's text: never from ids of whole images
            raise LlmcliError(f"image {image.label}: the chat's held text ends inside its marker")
        ids += _cut(prompt, begin).encode(tokenizer, at)
        ids += table.placeholder(image)
        if context_length is not None and len(ids) > context_length:
            raise LlmcliError(
                f"image {image.label}: the prompt needs {len(ids)} tokens up to the end of it, "
                f"and the context holds {context_length}",
                "send a smaller image, or fewer",
            )
        at = end
    ids += prompt.encode(tokenizer, at)
    if context_length is not None and len(ids) > context_length:
        names = ", ".join(image.label for image in images)
        raise LlmcliError(
            f"the prompt with its {'image' if len(images) == 1 else 'images'} ({names}) needs {len(ids)} "
            f"tokens, and the context holds {context_length}",
            "send a smaller image, or fewer",
        )
    return ids


def held_text(tokenizer: Any, held: Sequence[int], table: ImageTable | None, decode: Any) -> str:
    """The text `held` ids read as, an image's markers read as the template's image marker
    (what a rendering of the same chat writes there): `decode` decodes the runs of tokens."""
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

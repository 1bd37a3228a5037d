"""A loaded model's images, by content, and what their row markers (image_markers.py) stand for
in a pass. A negative id never reaches an embedding: the native backend asks the table
(`resolve`) for a pass's rows — the image's embeddings, which the vision tower makes once, when
a pass first needs them (an image whose rows are cached is never encoded again) — with their
positions and which rows see each other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmcli.engine.image_markers import ENTRIES, marker, split
from llmcli.errors import LlmcliError
from llmcli.models.vision.encoder import ImageInput, PreparedImage, VisionEncoder
from llmcli.models.vision.mrope import image_extent
from llmcli.models.vision.mrope import image_rows as image_layout

# Images kept with their processed pixels and (once encoded) their rows. A marker of an image
# dropped here is refused if a pass still needs it; the prompt that named it tokenizes it again.
KEPT_IMAGES = 64


@dataclass
class _Image:
    number: int
    label: str
    digest: str
    prepared: PreparedImage
    text: str  # its placeholder as text: what the template's marker is replaced with
    count: int  # its rows: the image tokens of its placeholder
    token_text: str = ""  # its image token's text, what each of its rows reads as
    rows: torch.Tensor | None = None  # the vision tower's output, once a pass needed it


@dataclass(frozen=True)
class PassImages:
    """What a pass's markers stand for: `tokens` the ids to embed (an image row's id is the
    pad id the family embeds there), the rows to replace and their embeddings, and — where the
    model asks — each row's image (for attention both ways inside an image) and the
    multimodal RoPE positions [3, T]."""

    tokens: torch.Tensor
    rows: torch.Tensor
    embeddings: torch.Tensor
    groups: torch.Tensor | None
    rope_positions: torch.Tensor | None
    # Where text positions move (KVCache.shifts): (the index after an image's last row, what
    # text positions add to their index from there), where an image's rows span fewer RoPE
    # positions than rows (Qwen).
    shifts: tuple[tuple[int, int], ...]


class ImageTable:
    """The images of one loaded model's prompts, by content: the same bytes are one image."""

    def __init__(self, encoder: VisionEncoder, pad_id: int) -> None:
        self.encoder = encoder  # built on first use (vision/load.py LazyEncoder): never for text alone
        self.pad_id = pad_id
        self._by_number: OrderedDict[int, _Image] = OrderedDict()
        self._by_digest: dict[str, int] = {}
        self._next = 0
        # Prompts are tokenized on a server's worker and passes run on the compute thread.
        self._lock = threading.Lock()

    @property
    def template_text(self) -> str:
        """What the chat template writes where a message holds an image."""
        return self.encoder.template_text

    # Tokenizing -----------------------------------------------------------------------------

    def expand(self, image: ImageInput, tokenizer: Any) -> str:
        """The text that stands for `image` in a prompt, where the template wrote its marker: its
        placeholder as the model's processor expands it (Gemma 3: its blank lines, which the
        tokenizer merges with the text around them, as transformers' processor has it). The
        image is opened, checked and processed now: a bad one is refused before anything is
        prefilled."""
        return self._image_of(image, tokenizer).text

    def _image_of(self, image: ImageInput, tokenizer: Any) -> _Image:
        from llmcli.engine.detok import decode_exact
        from llmcli.models.vision.image_file import open_image

        checked = open_image(image)
        with self._lock:
            number = self._by_digest.get(checked.digest)
            if number is not None and number in self._by_number:
                self._by_number.move_to_end(number)
                return self._by_number[number]
        prepared = self.encoder.prepare(checked.image)
        placeholder = prepared.placeholder
        count = sum(token == placeholder.image_token_id for token in placeholder.ids)
        if count >= ENTRIES:
            raise LlmcliError(f"image {image.label}: {count} tokens is more than one image may take")
        text = decode_exact(tokenizer, list(placeholder.ids))
        with self._lock:
            number = self._next
            self._next += 1
            token_text = decode_exact(tokenizer, [placeholder.image_token_id])
            kept = _Image(number, image.label, checked.digest, prepared, text, count, token_text)
            self._by_number[number] = kept
            self._by_digest[checked.digest] = number
            while len(self._by_number) > KEPT_IMAGES:
                _, dropped = self._by_number.popitem(last=False)
                self._by_digest.pop(dropped.digest, None)
            return kept

    def mark(self, ids: list[int], images: list[ImageInput], tokenizer: Any) -> list[int]:
        """`ids` (a prompt's tokens, `images` expanded in it in order) with each image token
        replaced by its image's row marker, the n-th image token the n-th row of the images in
        turn. Only the template's markup writes image tokens (control_text.py)."""
        kept = [self._image_of(image, tokenizer) for image in images]
        image_token = kept[0].prepared.placeholder.image_token_id if kept else None
        rows = [marker(one.number, row) for one in kept for row in range(one.count)]
        found = sum(token == image_token for token in ids)
        if found != len(rows):
            raise LlmcliError(
                f"image {kept[-1].label}: the prompt holds {found} image tokens for {len(rows)} "
                "image rows (the chat template wrote image tokens of its own)"
            )
        taken = iter(rows)
        return [next(taken) if token == image_token else token for token in ids]

    def rows_of(self, marker: int) -> int:
        """How many rows the image a marker names has."""
        return self._image(marker).count

    def text_of(self, marker: int) -> str:
        """The text a row marker reads as where a chat compares what it holds with a rendering:
        its image token's."""
        return self._image(marker).token_text

    # A pass -----------------------------------------------------------------------------------

    def _image(self, marker: int) -> _Image:
        number, _ = split(marker)
        with self._lock:
            image = self._by_number.get(number)
        if image is None:
            raise LlmcliError(
                f"an image of this prompt is no longer held (more than {KEPT_IMAGES} images came since): "
                "send it again"
            )
        return image

    def _rows(self, image: _Image) -> torch.Tensor:
        if image.rows is None:
            rows = self.encoder.encode(image.prepared)
            if rows.shape[0] != image.count:
                raise LlmcliError(
                    f"image {image.label}: the vision tower gave {rows.shape[0]} rows for "
                    f"{image.count} image tokens"
                )
            image.rows = rows
        return image.rows

    def resolve(
        self, ids: Sequence[int], start: int, shift: int, device: torch.device, dtype: torch.dtype
    ) -> PassImages | None:
        """What the markers in `ids` (a pass after `start` cached positions, text at position
        index + `shift` there) stand for; None where there are none."""
        if not any(token < 0 for token in ids):
            return None
        tokens: list[int] = []
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        groups: list[int] = []
        grids = any(self._image(token).prepared.placeholder.grid for token in ids if token < 0)
        positions: list[tuple[int, int, int]] = []
        text = start + shift  # the position the next text token takes
        # Each image in the pass (the same image twice is two): its rows' positions [3, rows] and
        # its group, by its number; a new one starts at its first row (or where the pass starts).
        current: dict[int, tuple[torch.Tensor | None, int]] = {}
        started = 0  # images begun in this pass: each one's group
        shifts: list[tuple[int, int]] = []
        for index, token in enumerate(ids):
            if token >= 0:
                tokens.append(token)
                groups.append(-1)
                positions.append((text, text, text))
                text += 1
                continue
            image = self._image(token)
            number, row = split(token)
            grid = image.prepared.placeholder.grid
            if row == 0 or number not in current:
                # Qwen's multimodal RoPE: the rows laid over the image's (time, height, width)
                # from the position it starts at (mrope.py). Until its end text positions move
                # one a row, so a pass that starts inside an image finds its start `row` back.
                layout = image_layout(text - row, grid) if grid is not None else None
                current[number] = (layout, started)
                started += 1
            layout, group = current[number]
            tokens.append(self.pad_id)
            rows.append(index)
            groups.append(group)
            pieces.append(self._rows(image)[row : row + 1])
            if layout is None:
                positions.append((text, text, text))
                text += 1
                continue
            positions.append(tuple(layout[:, row].tolist()))
            if row == image.count - 1:  # text goes on past the image's extent
                assert grid is not None
                text = int(layout[0, 0]) + image_extent(grid)
                shifts.append((start + index + 1, text - (start + index + 1)))
            else:
                text += 1
        embeddings = torch.cat(pieces).to(device=device, dtype=dtype) if pieces else torch.empty(0)
        bidirectional = bool(getattr(self.encoder, "bidirectional", False))
        return PassImages(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            embeddings=embeddings,
            groups=torch.tensor(groups, device=device) if bidirectional else None,
            rope_positions=torch.tensor(positions, device=device).T.contiguous() if grids else None,
            shifts=tuple(shifts),
        )


def table_of(loaded: Any) -> ImageTable | None:
    """The table of images of a loaded model (models/load.py LoadedModel), made on first use;
    None where the model reads text only."""
    vision = loaded.vision
    if vision is None:
        return None
    if vision.table is None:
        from llmcli.models.vision.load import LazyEncoder

        vision.table = ImageTable(LazyEncoder(vision), vision.pad_id)
    return vision.table

"""A loaded model's images, by content, and what their markers (image_markers.py) stand for in
a pass. A negative id never reaches an embedding: the native backend asks the table (`resolve`)
what a pass's markers stand for — an ordinary token (Gemma's <start_of_image>, Qwen's
<|vision_start|>) or a row of the image's embeddings, which the vision tower makes once, when a
pass first needs them (an image whose rows are cached is never encoded again).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    row_of: dict[int, int]  # placeholder entry → embedding row, for the image-token entries
    rows: torch.Tensor | None = None  # the vision tower's output, once a pass needed it
    entries: list[int] = field(default_factory=list)


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

    def __init__(self, encoder: VisionEncoder, pad_id: int, max_pixels: int | None = None) -> None:
        self.encoder = encoder  # built on first use (vision/load.py LazyEncoder): never for text alone
        self.pad_id = pad_id
        self.max_pixels = max_pixels
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

    def placeholder(self, image: ImageInput) -> list[int]:
        """The markers that stand for `image` in a prompt (opened, checked and processed now:
        a bad image is refused before anything is prefilled)."""
        from llmcli.models.vision.image_file import open_image

        checked = open_image(image) if self.max_pixels is None else open_image(image, self.max_pixels)
        with self._lock:
            number = self._by_digest.get(checked.digest)
            if number is not None and number in self._by_number:
                self._by_number.move_to_end(number)
                return list(self._by_number[number].entries)
        prepared = self.encoder.prepare(checked.image)
        placeholder = prepared.placeholder
        if len(placeholder.ids) >= ENTRIES:
            count = len(placeholder.ids)
            raise LlmcliError(f"image {image.label}: {count} tokens is more than one image may take")
        row_of: dict[int, int] = {}
        for entry, token in enumerate(placeholder.ids):
            if token == placeholder.image_token_id:
                row_of[entry] = len(row_of)
        with self._lock:
            number = self._next
            self._next += 1
            kept = _Image(number, image.label, checked.digest, prepared, row_of)
            kept.entries = [marker(number, entry) for entry in range(len(placeholder.ids))]
            self._by_number[number] = kept
            self._by_digest[checked.digest] = number
            while len(self._by_number) > KEPT_IMAGES:
                _, dropped = self._by_number.popitem(last=False)
                self._by_digest.pop(dropped.digest, None)
            return list(kept.entries)

    def rows_in(self, ids: Sequence[int]) -> int:
        """How many of `ids` are image rows (what --json's image_tokens counts)."""
        count = 0
        for token in ids:
            if token < 0:
                image = self._image(token)
                count += split(token)[1] in image.row_of
        return count

    def text_of(self, marker: int) -> str:
        """The text a marker reads as where a chat compares what it holds with a rendering:
        an image's first entry is the template's image marker, its other entries nothing."""
        return self.template_text if split(marker)[1] == 0 else ""

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
            if rows.shape[0] != len(image.row_of):
                raise LlmcliError(
                    f"image {image.label}: the vision tower gave {rows.shape[0]} rows for "
                    f"{len(image.row_of)} image tokens"
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
        grids = any(self._image(t).prepared.placeholder.grid for t in ids if t < 0)
        positions: list[tuple[int, int, int]] = []
        text = start + shift  # the position the next text token takes
        layouts: dict[int, torch.Tensor] = {}  # an image's number → its rows' positions [3, rows]
        shifts: list[tuple[int, int]] = []
        for index, token in enumerate(ids):
            if token >= 0:
                tokens.append(token)
                groups.append(-1)
                positions.append((text, text, text))
                text += 1
                continue
            image = self._image(token)
            number, entry = split(token)
            placeholder = image.prepared.placeholder
            row = image.row_of.get(entry)
            if row is None:  # an ordinary token of the placeholder
                tokens.append(placeholder.ids[entry])
                groups.append(-1)
                positions.append((text, text, text))
                text += 1
                continue
            tokens.append(self.pad_id)
            rows.append(index)
            groups.append(number)
            pieces.append(self._rows(image)[row : row + 1])
            grid = placeholder.grid
            if grid is None:
                positions.append((text, text, text))
                text += 1
                continue
            # Qwen's multimodal RoPE: the rows laid over the image's (time, height, width) from
            # the position it starts at (mrope.py); text after it goes on past its extent. Until
            # then text positions move one a row, so a pass that starts inside an image (a resume
            # there) finds the image's start `row` back.
            if number not in layouts:
                layouts[number] = image_layout(text - row, grid)
            positions.append(tuple(layouts[number][:, row].tolist()))
            if row == len(image.row_of) - 1:
                text = int(layouts[number][0, 0]) + image_extent(grid)
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

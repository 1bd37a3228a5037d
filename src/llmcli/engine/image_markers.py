"""An image's place in a prompt's token ids, as ids: each of an image's rows (its image tokens,
whose embeddings the vision tower gives) is a marker, a negative id naming the image and the row,
so that everything that compares, crops, keeps or restores token ids (the prefix store, chat
turns, the server's kept conversations) tells two images apart without knowing about images,
and the same image in a later prompt matches. The rest of an image's placeholder (Gemma's
<start_of_image>, Qwen's <|vision_start|>) is ordinary text. Torch-free: a chat through a
server compares them too.

    marker = −(1 + k · ENTRIES + row)   (k: the image's number in its table, image_rows.py)
"""

from __future__ import annotations

ENTRIES = 1 << 20  # rows one image may have (a 4K image in Qwen's patches: ~12k)


def marker(number: int, row: int) -> int:
    return -(1 + number * ENTRIES + row)


def split(marker: int) -> tuple[int, int]:
    """(the image's number, the row) a marker names."""
    return divmod(-marker - 1, ENTRIES)


def same_image(first: int, second: int) -> bool:
    """Whether two markers name entries of one image."""
    return split(first)[0] == split(second)[0]


def inside_image(ids: list[int], at: int) -> bool:
    """Whether a cut of `ids` at `at` falls between two rows of one image."""
    return 0 < at < len(ids) and ids[at] < 0 and ids[at - 1] < 0 and same_image(ids[at - 1], ids[at])


def chunk_ends(ids: list[int], size: int) -> list[int]:
    """Where the prefill chunks of `ids` end: every `size` tokens, moved back to the start of an
    image its end would cut (an image's rows may attend to each other both ways: Gemma), or on
    past an image longer than a chunk."""
    ends, at = [], 0
    while at < len(ids):
        end = min(at + size, len(ids))
        while inside_image(ids, end):
            end -= 1
        if end == at:  # an image longer than a chunk: whole, in one
            end = at + size
            while inside_image(ids, end):
                end += 1
        ends.append(end)
        at = end
    return ends

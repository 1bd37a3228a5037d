"""Images through llmcli's own decoder, held to transformers' whole model (vision tower and all)
on tiny random vision-language checkpoints of each family: the same ids and pixels give logits
within 1e-4 in fp32 after the prompt and at every decode step; an image's rows stay in the
cache across chat turns (never encoded again) and are told apart by content; `generate
--image` reports its image tokens and refuses a bad image in one line, naming it."""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from native_checks import load_lean

from tiny_models import (
    GEMMA_VISION,
    IDEFICS3_FAMILIES,
    MULTIMODAL_FAMILIES,
    build_tiny_idefics3,
    build_tiny_model,
)

FAMILIES = sorted(GEMMA_VISION) + sorted(MULTIMODAL_FAMILIES) + ["qwen2_5_vl"] + sorted(IDEFICS3_FAMILIES)
ATOL = 1e-4
STEPS = 4


def png(width: int, height: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = build_tiny_idefics3 if request.param in IDEFICS3_FAMILIES else build_tiny_model
    return build(tmp_path_factory.mktemp("vision") / request.param, request.param)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> Any:
    return load_lean(folder, "native")


@pytest.fixture(scope="module")
def reference(loaded: Any, folder: Path) -> Any:
    import transformers

    return (
        getattr(transformers, loaded.vision.architecture).from_pretrained(folder, dtype=torch.float32).eval()
    )


def two_images_asked(again: bool = False) -> list[dict[str, Any]]:
    """Two images with text around them; `again`: the first one a second time after them (one
    image twice in a prompt is two images, each its own positions and rows)."""
    from llmcli.models.vision.encoder import ImageInput

    first = {"type": "image", "image": ImageInput(png(40, 30, 1), "first")}
    content = [
        {"type": "text", "text": "look at"},
        first,
        {"type": "text", "text": "and"},
        {"type": "image", "image": ImageInput(png(20, 50, 2), "second")},
        {"type": "text", "text": "what is it?"},
        *([first, {"type": "text", "text": "and this?"}] if again else []),
    ]
    return [{"role": "user", "content": content}]


def reference_inputs(table: Any, ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    """The ids transformers' model reads for `ids` (each row's marker as the image token),
    and its image inputs: the processor's outputs of each image, in order, and the mask of
    image tokens that its mask or its positions read."""
    from llmcli.engine.image_markers import split

    real, prepared = [], []
    for token in ids:
        if token >= 0:
            real.append(token)
            continue
        image = table._image(token)
        real.append(image.prepared.placeholder.image_token_id)
        if split(token)[1] == 0:  # an image's first row
            prepared.append(image.prepared)
    inputs: dict[str, Any] = {}
    for name in prepared[0].inputs:
        values = [one.inputs[name] for one in prepared]
        # SmolVLM's tiles: [1, tiles, …] per image, one sample's images along the tiles
        tiles = name == "pixel_attention_mask" or (name == "pixel_values" and values[0].dim() == 5)
        inputs[name] = torch.cat(values, dim=int(tiles)) if isinstance(values[0], torch.Tensor) else values
    image_id = prepared[0].placeholder.image_token_id
    return real, inputs | {"image_mask": torch.tensor([[int(token == image_id) for token in real]])}


def reference_logits(reference: Any, real: list[int], inputs: dict[str, Any]) -> torch.Tensor:
    kwargs = {name: value for name, value in inputs.items() if name != "image_mask"}
    accepted = inspect.signature(reference.forward).parameters
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in accepted:
            kwargs[name] = torch.cat(
                [
                    inputs["image_mask"],
                    torch.zeros(1, len(real) - inputs["image_mask"].shape[1], dtype=torch.long),
                ],
                dim=1,
            )
    with torch.no_grad():
        return reference(input_ids=torch.tensor([real]), **kwargs).logits[0]


def test_the_vision_part_is_found_and_left_unread_until_an_image_comes(loaded: Any) -> None:
    assert loaded.vision is not None
    assert loaded.vision._encoder is None  # a text-only call never builds the tower


@pytest.mark.parametrize("again", [False, True], ids=["two images", "one of them twice"])
def test_prefill_and_every_step_match_transformers(loaded: Any, reference: Any, again: bool) -> None:
    from llmcli.engine.choose import backend_for
    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.image_rows import table_of

    table = table_of(loaded)
    ids = prompt_ids(loaded.tokenizer, two_images_asked(again), images=table)
    real, inputs = reference_inputs(table, ids)
    backend = backend_for(loaded)
    logits = backend.prefill(ids)
    steps = [
        int(token) for token in torch.randint(0, 300, (STEPS,), generator=torch.Generator().manual_seed(0))
    ]
    mine = [logits[0]]
    for token in steps[:-1]:
        mine.append(backend.decode(torch.tensor([token]))[0])
    theirs = reference_logits(reference, real + steps[:-1], inputs)[len(real) - 1 :]
    for step, (ours, transformers_row) in enumerate(zip(mine, theirs, strict=True)):
        assert (ours - transformers_row).abs().max().item() < ATOL, f"step {step}"


def test_a_prompt_resumed_anywhere_gives_the_logits_of_the_whole(loaded: Any) -> None:
    """The prefix store may resume a prompt at any point its cache can go back to (inside an
    image too: a recurrent state's checkpoint may fall there): the rest run then gives the
    whole's logits, RoPE positions and both-ways rows found again from the cache."""
    from llmcli.engine.choose import backend_for
    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.image_rows import table_of

    ids = prompt_ids(loaded.tokenizer, two_images_asked(), images=table_of(loaded))
    backend = backend_for(loaded)
    if hasattr(backend.cache, "interval"):
        backend.cache.interval = 3  # checkpoints every 3 tokens: resumes inside the images
    whole = backend.prefill(ids)
    resumed_inside = 0
    for cut in range(len(ids) - 1, 0, -2):
        backend.crop(cut)
        kept = backend.length
        resumed_inside += 0 < kept < len(ids) and ids[kept] < 0 and ids[kept - 1] < 0
        logits = backend.prefill(ids[kept:])
        assert (logits - whole).abs().max().item() < ATOL, f"resumed at {kept}"
    assert resumed_inside > 0


def test_image_positions_equal_transformers_rope_index(loaded: Any, reference: Any) -> None:
    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.image_rows import table_of

    if not hasattr(reference.model, "get_rope_index"):
        pytest.skip("one position per token: no multimodal RoPE")
    table = table_of(loaded)
    ids = prompt_ids(loaded.tokenizer, two_images_asked(), images=table)
    real, inputs = reference_inputs(table, ids)
    expected, _ = reference.model.get_rope_index(
        torch.tensor([real]), inputs["image_mask"], image_grid_thw=inputs["image_grid_thw"]
    )
    ours = table.resolve(ids, 0, 0, torch.device("cpu"), torch.float32).rope_positions
    assert torch.equal(ours, expected[:, 0])


def test_prefill_chunks_and_server_slices_never_cut_an_image() -> None:
    from llmcli.engine.image_markers import chunk_ends, marker

    image = [marker(3, row) for row in range(6)]
    ids = [1, 2, 3, *image, 4, 5, *[marker(4, row) for row in range(12)], 6]
    ends = chunk_ends(ids, 5)
    assert ends[-1] == len(ids) and ends == sorted(ends)
    starts = [0, *ends[:-1]]
    for start, end in zip(starts, ends, strict=True):
        assert end > start
        assert not (0 < end < len(ids) and ids[end] < 0 and ids[end - 1] < 0)  # no image cut
    assert ends[:2] == [3, 9]  # back to the image's start, then the image whole (longer than 5)


@pytest.mark.parametrize("family", ["gemma3_vl", "idefics3"])
def test_prompt_ids_equal_transformers_processor(family: str, tmp_path: Path) -> None:
    """The whole prompt's ids as transformers' own processor makes them from the template's
    text (the placeholder expanded in it and tokenized with the text around it), each image
    row's marker where the processor writes its image token."""
    import transformers
    from PIL import Image

    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.image_rows import table_of

    if family in IDEFICS3_FAMILIES:
        folder = build_tiny_idefics3(tmp_path / family, family)
    else:  # with a token for three newlines, as Gemma's vocabulary has: the placeholder's blank
        # lines merge with the newline before them only where the text is tokenized whole
        folder = build_tiny_model(tmp_path / family, family, added=("\n\n\n",))
    loaded = load_lean(folder, "native")
    table = table_of(loaded)
    messages = two_images_asked()
    messages[0]["content"] = messages[0]["content"][1:]  # an image first: right after "user\n"
    ours = prompt_ids(loaded.tokenizer, messages, images=table)
    processor_class = (
        transformers.Gemma3Processor if family == "gemma3_vl" else transformers.Idefics3Processor
    )
    config = json.loads((folder / "config.json").read_text())
    # The processors write the released models' rows per image unless told the tiny ones'
    if family == "gemma3_vl":
        rows = {"image_seq_length": config["mm_tokens_per_image"]}
    else:  # a tile's patches, shuffled together by the connector's scale factor
        vision = config["vision_config"]
        rows = {
            "image_seq_len": (vision["image_size"] // vision["patch_size"] // config["scale_factor"]) ** 2
        }
    processor = processor_class.from_pretrained(folder, **rows)
    text = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": p["type"], "text": p.get("text")} if p["type"] == "text" else {"type": "image"}
                    for p in m["content"]
                ],
            }
            for m in messages
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    pictures = [
        Image.open(io.BytesIO(p["image"].data)).convert("RGB")
        for p in messages[0]["content"]
        if p["type"] == "image"
    ]
    theirs = processor(text=text, images=pictures, add_special_tokens=False)["input_ids"][0]
    image_id = table._image(next(t for t in ours if t < 0)).prepared.placeholder.image_token_id
    assert [image_id if token < 0 else token for token in ours] == list(theirs)

"""An image in a chat and on the command line: its rows stay cached across turns (the vision
tower runs once per image), a chat's later turn equals a fresh prefill of the whole, two images
are told apart by content; `generate --image` and `chat`'s /image and pasted paths, each bad
image refused in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation
from llmcli.engine.image_rows import table_of
from llmcli.models.vision.encoder import ImageInput
from native_checks import load_lean
from test_vision_engine import png

from cli_helpers import one_error_line, run_cli
from tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.fixture(scope="module", params=["gemma3_vl", "qwen3_5_vl"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vision-chat") / request.param, request.param)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> Any:
    return load_lean(folder, "native")


def with_image(text: str, data: bytes, label: str) -> list[dict[str, Any]]:
    return [{"type": "image", "image": ImageInput(data, label)}, {"type": "text", "text": text}]


def test_an_image_is_encoded_once_and_its_rows_stay_cached_across_turns(loaded: Any) -> None:
    table = table_of(loaded)
    encoded: list[int] = []
    encoder = table.encoder.source.encoder()
    real_encode = encoder.encode
    encoder.encode = lambda prepared: encoded.append(1) or real_encode(prepared)  # counts, runs the real one
    try:
        engine = engine_for(loaded)
        conversation = Conversation(loaded.tokenizer, loaded.context_length, images=table)
        picture = png(36, 28, 7)
        turns = [
            with_image("what is it?", picture, "photo.png"),
            "and the colour?",
            with_image("again?", picture, "same.png"),
        ]
        results = []
        for message in turns:
            prompt, dropped = conversation.prompt_for(message, GREEDY.max_new_tokens)
            generation = engine.generate(prompt, GREEDY, loaded.tokenizer)
            list(generation)
            result = generation.result
            conversation.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
            results.append((prompt, result))
        assert len(encoded) == 1
        first_prompt, _ = results[0]
        image_end = max(at for at, token in enumerate(first_prompt) if token < 0) + 1
        for prompt, result in results[1:]:
            assert prompt[:image_end] == first_prompt[:image_end]  # the image held as it was
            assert result.stats.cached_tokens >= image_end
        # The last turn, run whole on a fresh engine, gives the same tokens.
        prompt, result = results[-1]
        fresh = engine_for(loaded).generate(prompt, GREEDY, loaded.tokenizer)
        list(fresh)
        assert fresh.result.token_ids == result.token_ids
    finally:
        del encoder.encode


def test_two_images_are_told_apart_and_the_same_image_matches(loaded: Any) -> None:
    from llmcli.engine.conversation import prompt_ids

    table = table_of(loaded)

    def ids(data: bytes, label: str) -> list[int]:
        return prompt_ids(
            loaded.tokenizer, [{"role": "user", "content": with_image("hi", data, label)}], images=table
        )

    first, again, other = (
        ids(png(30, 30, 1), "a.png"),
        ids(png(30, 30, 1), "b.png"),
        ids(png(30, 30, 2), "c.png"),
    )
    assert first == again  # the same bytes: the same markers, so a cached prefix matches
    assert first != other and len(first) == len(other)  # the same size, another image: no match


def test_generate_with_an_image_reports_its_tokens(folder: Path, tmp_path: Path) -> None:
    picture = tmp_path / "photo.png"
    picture.write_bytes(png(33, 21, 3))

    def greedy(image: str, stdin: bytes = b"") -> dict[str, Any]:
        args = ("-m", str(folder), "--image", image, "describe it", "--json", "-n", "3", "-t", "0")
        proc = run_cli("generate", *args, stdin=stdin)
        assert proc.returncode == 0, proc.stderr.decode()
        return json.loads(proc.stdout)

    record = greedy(str(picture))
    assert record["image_tokens"] > 0 and record["prompt_tokens"] > record["image_tokens"]
    from_stdin = greedy("-", picture.read_bytes())
    assert from_stdin["text"] == record["text"]


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"not an image at all", "not an image"), (b"", "empty"), (png(20, 20, 0)[:60], "")],
)
def test_a_bad_image_is_refused_in_one_line_naming_it(
    folder: Path, tmp_path: Path, content: bytes, says: str
) -> None:
    picture = tmp_path / "bad.png"
    picture.write_bytes(content)
    line = one_error_line(run_cli("generate", "-m", str(folder), "--image", str(picture), "hi"), 2)
    assert str(picture) in line and says in line


def test_chat_attaches_an_image_by_command_or_pasted_path(folder: Path, tmp_path: Path) -> None:
    picture = tmp_path / "my photo.png"
    picture.write_bytes(png(24, 24, 5))
    script = f"/image {picture}\n/undo\n'{picture}'\nwhat is it?\nand now?\n"
    proc = run_cli(
        "chat", "-m", str(folder), "--json", "-n", "3", "--temperature", "0", stdin=script.encode()
    )
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(turns) == 2
    assert turns[0]["image_tokens"] > 0
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"] - 1
    err = proc.stderr.decode()
    assert err.count("attached") == 2 and "took back the image" in err


def test_an_image_the_context_cannot_hold_is_refused_naming_it(folder: Path, tmp_path: Path) -> None:
    picture = tmp_path / "wide.png"
    picture.write_bytes(png(64, 48, 4))
    line = one_error_line(
        run_cli("generate", "-m", str(folder), "--ctx", "16", "--image", str(picture), "hi"), 1
    )
    assert str(picture) in line and "context" in line


def test_an_image_for_a_text_model_or_with_a_drafting_model_is_refused(
    folder: Path, tiny_model: Path, tmp_path: Path
) -> None:
    picture = tmp_path / "photo.png"
    picture.write_bytes(png(20, 20, 6))
    line = one_error_line(run_cli("generate", "-m", str(tiny_model), "--image", str(picture), "hi"), 1)
    assert str(picture) in line and "reads text only" in line
    line = one_error_line(run_cli("generate", "-m", str(folder), "--image", str(picture), "--raw", "hi"), 2)
    assert "--raw" in line


def test_the_repl_takes_an_image_dropped_on_its_prompt_and_keeps_it_in_save_and_load(
    folder: Path, tmp_path: Path
) -> None:
    from test_repl import Repl

    picture = tmp_path / "drop me.png"
    picture.write_bytes(png(26, 22, 9))
    repl = Repl("-m", str(folder), "-t", "0", "-n", "3")
    assert "attached" in repl.send(f"'{picture}'")  # as a file manager drops a path with a space
    assert "took back the image" in repl.send("/undo")
    assert "attached" in repl.send(f"/image {picture}")
    _, first = repl.turn("what is it?")
    _, second = repl.turn("and now?")
    assert int(second.group(2)) > int(first.group(1)) - 2  # the image's rows reused, not prefilled
    transcript = tmp_path / "chat.json"
    assert "saved 4 messages" in repl.send(f"/save {transcript}")  # two exchanges
    assert "loaded 4 messages" in repl.send(f"/load {transcript}")
    assert "image" in json.loads(transcript.read_text())["messages"][0]["content"][0]["type"]
    assert repl.quit() == 0


def test_another_question_about_the_same_image_runs_none_of_its_rows_again(loaded: Any) -> None:
    """A checkpoint where an image ends (a recurrent state's too): a second prompt that shares
    the image and differs after it resumes past every row of it."""
    from llmcli.engine.conversation import prompt_ids

    table = table_of(loaded)
    engine = engine_for(loaded)
    picture = png(40, 36, 12)
    asked = []
    for question in ("what is it?", "which colour is it?"):
        messages = [{"role": "user", "content": with_image(question, picture, "photo.png")}]
        ids = prompt_ids(loaded.tokenizer, messages, images=table)
        generation = engine.generate(ids, GREEDY, loaded.tokenizer)
        list(generation)
        asked.append((ids, generation.result.stats.cached_tokens))
    (first, _), (_, cached) = asked
    image_end = max(at for at, token in enumerate(first) if token < 0) + 1
    assert cached >= image_end


def test_an_image_with_beam_search_is_refused_and_user_turns_with_images_merge_as_parts(
    folder: Path, tmp_path: Path
) -> None:
    from llmcli.engine.tools.formats import _merge_turns

    picture = tmp_path / "photo.png"
    picture.write_bytes(png(20, 20, 8))
    line = one_error_line(
        run_cli("generate", "-m", str(folder), "--image", str(picture), "--num-beams", "2", "hi"), 2
    )
    assert "--num-beams" in line
    image = {"type": "image", "image": ImageInput(b"x", "a")}
    merged = _merge_turns([{"role": "user", "content": [image]}, {"role": "user", "content": "and?"}])
    assert merged == [
        {
            "role": "user",
            "content": [image, {"type": "text", "text": "\n\n"}, {"type": "text", "text": "and?"}],
        }
    ]

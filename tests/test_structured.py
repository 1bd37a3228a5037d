"""Constrained decoding: every reply of a random tiny model validates against its schema (the
constraint does all the work), bad schemas are refused before the model loads, a reply cut short
exits 1, and chat, --batch and the server honour formats as generate does."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engines import engine_for
from llmcli.config.settings import OutputSettings, SamplingParams
from llmcli.engine.structured import OutputFormat
from llmcli.engine.structured.constraint import Constraint
from llmcli.engine.structured.grammar import _compiled
from llmcli.errors import UsageError
from llmcli.frontends.formats import output_format

from cli_helpers import run_cli

# Bounded where a random model could otherwise go on for ever (free strings, open arrays).
SCHEMAS = {
    "nested objects, required and optional": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "nickname": {"type": "string", "maxLength": 6},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays and enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "size": {"enum": ["S", "M", "L", 3]},
        },
        "required": ["colors", "size"],
        "additionalProperties": False,
    },
    "numbers with bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
        "additionalProperties": False,
    },
    "strings with patterns": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{1,3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "an array at the top": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
}


def constrained(loaded, schema: dict, seed: int, tokens: int = 200):
    engine = engine_for(loaded)
    output = OutputFormat(schema, "test")
    constraint = Constraint(output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    ids = loaded.tokenizer("Reply in JSON.")["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=seed)
    generation = engine.generate(ids, params, loaded.tokenizer, constraint)
    list(generation)
    return generation.result


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_reply_of_a_random_model_validates(loaded_tiny, name: str) -> None:
    schema = SCHEMAS[name]
    for seed in range(4):  # sampled at temperature 1: four different replies
        result = constrained(loaded_tiny, schema, seed)
        assert result.value_complete, (name, seed, result.text)
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), schema)


def test_without_the_constraint_the_random_model_writes_no_json(loaded_tiny) -> None:
    """The check above can fail: the same model, unconstrained, does not produce valid JSON."""
    engine = engine_for(loaded_tiny)
    ids = loaded_tiny.tokenizer("Reply in JSON.")["input_ids"]
    generation = engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=60, seed=0), None)
    list(generation)
    text = loaded_tiny.tokenizer.decode(generation.result.token_ids)
    with pytest.raises(ValueError):
        json.loads(text)


def test_format_json_parses_through_the_cli(tiny_llama: Path) -> None:
    proc = run_cli("generate", "-m", str(tiny_llama), "--device", "cpu", "--format", "json", "-n", "300",
                   "--json", "-t", "0.9", "--seed", "3", "Describe a cat as JSON")  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert isinstance(json.loads(record["text"]), dict) and record["value"] == json.loads(record["text"])
    assert record["finish_reason"] == "stop" and record["format"] == "--format json"
    assert proc.stderr == b""


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ('{"type": "strin"}', "Invalid type: strin"),
        ('{"type": "integer", "minimum": 5, "maximum": 3}', "minimum (5) is greater than maximum (3)"),
        ('{"enum": []}', "Unsatisfiable schema"),
        ('{"allOf": [{"type": "string"}, {"type": "integer"}]}', "Unsatisfiable schema"),
        ('{"type": "object", ', "not valid JSON"),
        ("no-such-schema.json", "no such file"),
        ('{"$ref": "#"}', "no finite JSON value satisfies it"),
        ('{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}', "no finite JSON value"),
        ('{"type": "array", "items": {"$ref": "#"}, "minItems": 1}', "no finite JSON value"),
        ('{"type": "object", "properties": {"a": ' + "[" * 5000 + "]" * 5000 + "}}", "nested too deeply"),
    ],
)
def test_bad_schemas_are_refused_before_the_model_loads(schema: str, message: str) -> None:
    # The model does not exist: reaching it would be another error. The schema is refused first.
    proc = run_cli("generate", "-m", "/nonexistent/model", "--json-schema", schema, "hi")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and message in err and "/nonexistent" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_reply_cut_by_the_token_limit_exits_1_naming_it(tiny_llama: Path) -> None:
    schema = json.dumps(SCHEMAS["nested objects, required and optional"])
    args = ["generate", "-m", str(tiny_llama), "--device", "cpu", "--json-schema", schema, "-n", "4"]
    with_json = run_cli(*args, "--json", "hi")
    assert with_json.returncode == 1
    err = with_json.stderr.decode()
    assert "not a complete JSON value" in err and "--max-new-tokens 4" in err
    record = json.loads(with_json.stdout)
    assert record["finish_reason"] == "length" and record["value"] is None
    assert record["completion_tokens"] == 4


def test_format_with_beams_or_speculation_is_refused(tiny_llama: Path) -> None:
    for extra, message in (
        (["--num-beams", "2"], "do not combine"),
        (["--speculative", "lookup"], "do not combine yet"),
    ):
        proc = run_cli("generate", "-m", str(tiny_llama), "--format", "json", *extra, "hi")
        assert proc.returncode == 2 and message in proc.stderr.decode()


def test_chat_format_on_and_off(tiny_llama: Path, tmp_path: Path) -> None:
    schema = tmp_path / "color.json"
    schema.write_text(json.dumps({"enum": ["red", "green"]}))
    lines = f"/format json\nA cat\n/format schema {schema}\nA color\n/format off\nHello\n/format xml\n"
    proc = run_cli("chat", "-m", str(tiny_llama), "--device", "cpu", "-n", "300", "--json", "-t", "0.9",
                   "--seed", "1", stdin=lines.encode())  # fmt: skip
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(turns) == 3
    assert isinstance(json.loads(turns[0]["reply"]), dict)
    assert json.loads(turns[1]["reply"]) in ("red", "green")
    with pytest.raises(ValueError):  # format off: the random model's text again
        json.loads(turns[2]["reply"])
    assert "usage: /format json | schema FILE | off" in proc.stderr.decode()
    assert proc.returncode == 1  # the bad /format line is an error of the scripted chat


def test_batch_lines_may_bring_their_own_schema(tiny_llama: Path, tmp_path: Path) -> None:
    colors = {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 2, "maxItems": 2}
    lines = [
        json.dumps({"prompt": "two colors", "schema": colors}),
        "any object please",
        json.dumps({"prompt": "a number", "schema": {"type": "integer", "minimum": 1, "maximum": 9}}),
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    # The command line's format, for the line without its own: an object, its string bounded (a
    # random model's free string ends only by chance: --format json finished here by luck).
    given = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    proc = run_cli("generate", "-m", str(tiny_llama), "--device", "cpu", "--batch", str(batch), "--json",
                   "--json-schema", json.dumps(given), "-n", "300", "--seed", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    jsonschema.validate(records[0]["value"], colors)
    assert isinstance(records[1]["value"], dict)
    assert 1 <= records[2]["value"] <= 9 and isinstance(records[2]["value"], int)


def test_a_schema_compiles_once() -> None:
    schema = json.dumps({"type": "object", "properties": {"once": {"type": "integer"}}})
    before = _compiled.cache_info()
    output_format(OutputSettings(json_schema=schema))
    output_format(OutputSettings(json_schema=schema))
    after = _compiled.cache_info()
    assert after.misses == before.misses + 1 and after.hits >= before.hits + 1
    with pytest.raises(UsageError):
        output_format(OutputSettings(format="yaml"))


def test_properties_come_in_the_schemas_order(loaded_tiny) -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}, "mid": {"type": "boolean"}},
        "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False,
    }
    result = constrained(loaded_tiny, schema, seed=0)
    assert list(json.loads(result.text)) == ["zeta", "alpha", "mid"]


def test_items_are_separated_as_json_is_usually_written(loaded_tiny) -> None:
    """ ", " and ": " between items, as models saw JSON written (compact separators put the demo
    off: docs/benchmarks.md), and no other whitespace."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    for seed in range(3):
        text = constrained(loaded_tiny, schema, seed=seed).text
        assert text == json.dumps(json.loads(text)), text  # Python's separators are ", " and ": "


def test_a_value_cut_while_the_model_loops_is_said_so_not_more_tokens() -> None:
    """A value cut by the limit: when the model was repeating itself, the line says so and
    what helps (a prompt, a closed schema, a bigger model), not only to raise the limit."""
    from llmcli.engine.structured import ANY_OBJECT
    from llmcli.frontends.formats import unfinished_value

    any_object = OutputFormat(ANY_OBJECT, "--format json")
    cut = ("length", 512, 512, "--max-new-tokens")
    looping = unfinished_value(any_object, *cut, '{"population": ' + "1" * 500)
    assert looping.startswith("the reply is not a complete JSON value (--format json): --max-new-tokens 512")
    assert 'the model was repeating "1"' in looping and "more tokens would only repeat it" in looping
    assert "prompt that names the keys" in looping and "bigger model" in looping
    open_schema = OutputFormat({"type": "object", "properties": {"a": {"type": "string"}}}, "--json-schema x")
    adding = unfinished_value(open_schema, *cut, '{"a": "x", "b": {"c": "Paris is')
    assert "had not finished it" in adding and '"additionalProperties": false' in adding
    assert "raise the limit only if the value is that long" in adding
    stopped = unfinished_value(any_object, "stop", 9, 512, "--max-new-tokens", '{"a": "b')
    assert "a stop string cut it; give one that the value cannot contain" in stopped


def test_a_string_keys_rule_is_left_out_and_names_and_data_are_kept() -> None:
    """`propertyNames: {"type": "string"}` says what every JSON key is already; a property of
    that name, and the same object as a const's data, are the schema's own and stay."""
    from llmcli.engine.structured import parse_schema

    keys = {"type": "string"}
    schema = {
        "type": "object",
        "propertyNames": keys,
        "properties": {"propertyNames": keys, "fixed": {"const": {"propertyNames": keys}}},
        "$defs": {"map": {"type": "object", "propertyNames": keys}},
    }
    assert parse_schema(schema, "x") == {
        "type": "object",
        "properties": {"propertyNames": keys, "fixed": {"const": {"propertyNames": keys}}},
        "$defs": {"map": {"type": "object"}},
    }

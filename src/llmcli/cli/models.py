"""`llmcli models …` and `llmcli config …`: living with models and settings. No torch imports
except where a command needs a model (pull of nothing, import of a GGUF file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llmcli.cli.support import handled_errors
from llmcli.errors import LlmcliError, ModelNotFoundError, UsageError

models_app = typer.Typer(help="List, fetch, inspect, import and remove models.", no_args_is_help=False)
config_app = typer.Typer(
    help="The config file: where it is, and the settings in effect.", no_args_is_help=False
)


def _print(text: str) -> None:
    sys.stdout.write(text + "\n")


def _bytes(count: int | None) -> str:
    from llmcli.models.memory import format_bytes

    return "—" if count is None else format_bytes(count)


@models_app.command("list")
def list_models(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
) -> None:
    """Models in the Hugging Face cache and llmcli's converted GGUF files."""
    with handled_errors():
        from llmcli.models.catalog import list_models as entries_of
        from llmcli.models.gguf_cache import folder_size, leftovers
        from llmcli.models.resolve import DEFAULT_ALIAS

        entries = entries_of()
        left = sum(folder_size(folder) for folder in leftovers())
        if json_output:
            _print(json.dumps([e.as_dict() for e in entries], indent=2))
            return
        if left:
            _print(
                f"{_bytes(left)} held by conversions that were killed before they finished: "
                "the next conversion removes them, or `llmcli models rm --leftovers` now.\n"
            )
        if not entries:
            _print("No models yet: `llmcli models pull ORG/NAME`, or `llmcli models import FILE.gguf`.")
            return
        rows = [
            (
                "*" if e.default else "",
                e.name,
                e.revision,
                _bytes(e.size_bytes),
                e.architecture or "—",
                f"{e.parameters / 1e9:.2f} B" if e.parameters else "—",
                str(e.context_length or "—"),
                "yes" if e.chat_template else "no",
            )
            for e in entries
        ]
        header = ("", "NAME", "REVISION", "ON DISK", "ARCHITECTURE", "PARAMS", "CONTEXT", "CHAT")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            _print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if any(e.default for e in entries):
            _print(
                f"\n* the default model (no -m); -m {DEFAULT_ALIAS} names it. "
                "`llmcli models show NAME`: its size in memory."
            )


@models_app.command("pull")
def pull(
    model: Annotated[str, typer.Argument(help="Hub id, org/name[@revision].")],
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept pickled weights.")] = False,
) -> None:
    """Download config, tokenizer and safetensors into the Hugging Face cache (resumable)."""
    with handled_errors():
        from llmcli.config.user_config import load_user_config
        from llmcli.models.resolve import expand_default_alias, resolve_hub

        spec = load_user_config().expand(model, expand_default_alias) or model
        repo_id, _, revision = spec.partition("@")
        folder = resolve_hub(repo_id, revision or None, allow_pickle=allow_pickle)
        _print(f"{spec} is in {folder}")


@models_app.command("show")
def show(
    model: Annotated[
        str | None,
        typer.Argument(
            help="A model name from `models list`, an alias, a folder, a .gguf file or a Hub id. "
            "Default: the default model.",
            show_default=False,
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    template: Annotated[bool, typer.Option("--template", help="Print the whole chat template.")] = False,
) -> None:
    """Config summary, chat template, generation defaults, sizes on disk and in memory."""
    with handled_errors():
        from llmcli.models.catalog import model_summary
        from llmcli.models.checkpoint import Checkpoint
        from llmcli.models.engine_verdict import engine_under_auto
        from llmcli.models.load_plan import settled_load
        from llmcli.models.resolve import default_model_spec, is_gguf_spec

        spec = model or default_model_spec()
        folder, source, gguf_file = _local_folder(spec)
        checkpoint = Checkpoint(folder.name, folder, source)
        summary = model_summary(checkpoint, spec if model else _display_name(spec))
        device, dtype, quant, here = settled_load(checkpoint)
        summary["on_disk_bytes"] = {"folder": summary.pop("folder_bytes")}
        if gguf_file is not None:
            summary["on_disk_bytes"]["gguf_file"] = gguf_file.stat().st_size
        summary["in_memory"] = {"device": device, "dtype": dtype, "quant": quant, "weight_bytes": here}
        fields = ("dtype", "quant", "weight_bytes")
        summary["with_quant"] = {  # each --quant as it would load here, in the dtype it would use
            kind: dict(zip(fields, settled_load(checkpoint, kind)[1:], strict=True))
            for kind in ("none", "int8", "int4")
        }
        summary["gguf_type"] = checkpoint.gguf_type
        summary["is_gguf"] = is_gguf_spec(spec)
        summary["engine"] = engine_under_auto(checkpoint.architecture)
        if json_output:
            _print(json.dumps(summary, indent=2))
            return
        template_text = summary["chat_template_text"] or ""
        shape = (
            f"{summary['architecture']} · {summary['layers']} layers · hidden {summary['hidden_size']} · "
            f"{summary['attention_heads']} heads ({summary['kv_heads']} KV) · vocab {summary['vocab_size']}"
        )
        weights = " · ".join(
            f"{kind} {_bytes(plan['weight_bytes'])} ({plan['dtype']})"
            for kind, plan in summary["with_quant"].items()
        )
        kv_dtype = summary["in_memory"]["dtype"]
        kv = _bytes(summary["kv_bytes_per_token_bf16"] * (2 if kv_dtype == "fp32" else 1))
        defaults = _sampling_defaults(summary["generation_defaults"])
        disk = summary["on_disk_bytes"]
        where, read_in_place = "in its files", False
        if gguf_file or source == "gguf":
            read_in_place = checkpoint.read_in_place
            where = (
                "its tokenizer and settings in llmcli's cache"
                if read_in_place
                else "converted, in llmcli's cache"
            )
        on_disk = f"{_bytes(disk['folder'])} {where}"
        if gguf_file is not None:
            on_disk = f"{_bytes(disk['gguf_file'])} the GGUF file · {on_disk}"
        loaded = summary["in_memory"]
        quant_note = "" if loaded["quant"] == "none" else f", {loaded['quant']} weights"
        template_line = "yes" if template_text else "none"
        if template_text and not template:
            template_line += f" ({len(template_text)} characters; --template prints it)"
        parameters = f"{summary['parameters'] / 1e9:.3f} B" if summary["parameters"] else "—"
        lines = [
            f"{summary['name']}  ({summary['path']})",
            f"architecture   {shape}",
            f"parameters     {parameters}",
            f"context        {summary['context_length']} tokens",
            f"checkpoint     {_checkpoint(summary, source, read_in_place)}",
            f"on disk        {on_disk}",
            f"in memory      weights {_bytes(loaded['weight_bytes'])} as it loads here by default "
            f"({loaded['device']}, {loaded['dtype']}{quant_note})",
            f"               with --quant: {weights}",
            f"               KV cache {kv}/token in {kv_dtype}",
            f"sampling       {defaults}",
            f"chat template  {template_line}",
            f"engine         {summary['engine']['auto']} under --engine auto ({summary['engine']['why']})",
        ]
        if template and template_text:
            lines += ["", template_text]
        _print("\n".join(lines))


def _is_the_defaults_conversion(model: str) -> bool:
    """Whether removing `model` removes the default model's GGUF conversion too (an import of
    the same file shares it)."""
    from llmcli.models.gguf_cache import conversion_of, find_imported
    from llmcli.models.resolve import default_model_spec

    folder = find_imported(model)
    default = default_model_spec()
    if folder is None or not default.endswith(".gguf") or not Path(default).is_file():
        return False
    return folder.resolve() == conversion_of(Path(default).resolve()).resolve()


def _checkpoint(summary: dict[str, Any], source: str, read_in_place: bool) -> str:
    """How the weights are stored: a GGUF file's type, a checkpoint's quantization, or neither."""
    if source == "gguf":
        kind = summary.get("gguf_type")
        stored = f"GGUF {kind}" if kind else "GGUF"
        if read_in_place:
            # Which layers keep their blocks depends on the device: the "loads as" line says.
            return (
                f"{stored}, read from the file (its blocks kept where llmcli's kernels multiply them, "
                "else 4-bit blocks as int4 codes and wider blocks as int8)"
            )
        return f"{stored}, converted to fp16 safetensors (4-bit blocks kept as int4 codes)"
    return summary["quantization"] or "not quantized"


def _display_name(spec: str) -> str:
    from llmcli.models.resolve import DEFAULT_ALIAS

    return f"{Path(spec).stem if spec.endswith('.gguf') else spec} (the default model, {DEFAULT_ALIAS})"


def _sampling_defaults(generation: dict[str, Any]) -> str:
    """generation_config.json's sampling values, the ones a user tunes; the rest is plumbing."""
    keys = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")
    shown = [f"{key} {generation[key]}" for key in keys if generation.get(key) is not None]
    return (
        " · ".join(shown)
        if shown
        else "none set by the model (llmcli's built-ins apply: `llmcli config show`)"
    )


def _local_folder(model: str) -> tuple[Path, str, Path | None]:
    """A model that is here already (show never downloads; a .gguf file is converted once)."""
    from llmcli.config.user_config import load_user_config
    from llmcli.frontends.loading import announce_conversion
    from llmcli.models.resolve import expand_default_alias, find_local

    return find_local(load_user_config().expand(model, expand_default_alias) or model, announce_conversion)


@models_app.command("rm")
def remove(
    model: Annotated[str | None, typer.Argument(help="A name from `models list`.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    leftovers: Annotated[
        bool, typer.Option("--leftovers", help="Only remove what killed conversions left behind.")
    ] = False,
) -> None:
    """Delete a model from the cache (asks first unless --yes), and what killed conversions left."""
    with handled_errors():
        from llmcli.models.catalog import list_models as entries_of
        from llmcli.models.catalog import remove_model
        from llmcli.models.gguf_cache import remove_leftovers

        if model is None:
            if not leftovers:
                raise UsageError("llmcli models rm needs a model name (or --leftovers)")
            _print(f"Removed leftovers of killed conversions: {_bytes(remove_leftovers())} freed.")
            return
        if leftovers:
            raise UsageError("--leftovers removes only leftovers: give it without a model name")
        matches = [e for e in entries_of() if e.name == model.partition("@")[0]]
        if not matches:
            raise ModelNotFoundError(f"no model named {model} in the caches", "see `llmcli models list`")
        size = sum(e.size_bytes if e.cache_bytes is None else e.cache_bytes for e in matches)
        # A GGUF file read in place is the user's: removing its model frees llmcli's folder alone.
        files = sorted({e.gguf_file for e in matches if e.gguf_file})
        stays = f"; {', '.join(files)} stays where it is" if files else ""
        if not yes:
            if not sys.stdin.isatty():
                raise UsageError(f"removing {model} ({_bytes(size)}{stays}) needs confirmation: pass --yes")
            if not typer.confirm(f"Remove {model} ({_bytes(size)}{stays})?", default=False):
                _print("Kept.")
                return
        from llmcli.models.resolve import DEFAULT_ALIAS

        shared = _is_the_defaults_conversion(model)
        freed = remove_model(model)
        left = remove_leftovers()
        extra = f", and {_bytes(left)} left by killed conversions" if left else ""
        _print(f"Removed {model}: {_bytes(freed)} freed{extra}{stays}.")
        if shared:
            _print(
                f"It was also the conversion of the default model ({DEFAULT_ALIAS}): "
                "its next use converts the GGUF file again."
            )


@models_app.command("import")
def import_gguf(
    file: Annotated[Path, typer.Argument(help="A .gguf file (llama.cpp / ollama).")],
    name: Annotated[
        str | None, typer.Option(help="The name -m will know it by. Default: the file's stem.")
    ] = None,
) -> None:
    """Convert a GGUF file once into llmcli's cache, so later loads take a second."""
    with handled_errors():
        from llmcli.models.gguf_cache import find_imported

        if not file.is_file():
            raise UsageError(f"{file} does not exist")
        if name and (existing := find_imported(name)) is not None and not existing.name.startswith(file.stem):
            raise UsageError(f"the name {name!r} is taken by {existing}", f"`llmcli models rm {name}` first")
        from llmcli.frontends import terminal
        from llmcli.models.gguf import converted_folder

        with terminal.status(f"Reading {file.name}…"):
            folder = converted_folder(file, name=name or file.stem)
        _print(f"Imported {file.name} as {name or file.stem} ({folder})")


@config_app.command("path")
def path() -> None:
    """Where the config file is (or would be)."""
    from llmcli.config.user_config import config_path

    _print(str(config_path()))


@config_app.command("show")
def show_config(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Show the settings for this model.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """The settings in effect, and where each came from."""
    with handled_errors():
        from llmcli.config.effective import effective_settings
        from llmcli.config.user_config import load_user_config
        from llmcli.frontends.config_check import warn_about_unmatched_sections
        from llmcli.models.resolve import expand_default_alias, names_of

        config = load_user_config()
        effective = effective_settings(model, {}, config, expand=expand_default_alias, names=names_of)
        warn_about_unmatched_sections(config)
        generation_config = _generation_config_of(effective.model)
        params, filled = effective.sampling.resolve_with_sources(generation_config or {})
        sources = {**filled, **effective.sources}
        from llmcli.models.resolve import DEFAULT_ALIAS, default_model_spec

        model_source = effective.model_source
        if effective.model is None:
            model_source = f"built-in default ({DEFAULT_ALIAS})"
        rows: list[tuple[str, Any, str]] = [("model", effective.model or default_model_spec(), model_source)]
        for key, value in params.as_dict().items():
            if key in ("seed", "stop") and key not in effective.sources:
                value, source = (None if key == "seed" else []), "built-in"
            else:
                source = sources.get(key, "built-in")
            rows.append((key, list(value) if isinstance(value, tuple) else value, source))
        rows.append(("system", effective.system, effective.sources.get("system", "built-in")))
        rows.append(("ctx", effective.context_length, effective.sources.get("ctx", "the model's")))
        rows.append(("engine", effective.engine or "auto", effective.sources.get("engine", "built-in")))
        speculative = effective.speculative
        for key, value in (
            ("speculative", speculative.method),
            ("draft_model", speculative.draft_model),
            ("draft_tokens", speculative.draft_tokens if speculative.draft_tokens else "adaptive"),
        ):
            # --draft-model alone turns drafting on: the method then comes from where the model did.
            default = effective.sources.get("draft_model", "built-in") if key == "speculative" else "built-in"
            rows.append((key, value, effective.sources.get(key, default)))
        for key, value, unset in (
            ("think", effective.think, "built-in (show on a terminal, hide in a pipe)"),
            ("think_budget", effective.think_budget, "built-in (none)"),
            ("keep_alive", effective.keep_alive, "built-in (off)"),
            ("prompt_cache_size", effective.load.prompt_cache_size, "built-in (2GiB)"),
        ):
            rows.append((key, value, effective.sources.get(key, unset)))
        if json_output:
            _print(
                json.dumps({key: {"value": value, "source": source} for key, value, source in rows}, indent=2)
            )
            return
        width = max(len(key) for key, _, _ in rows)
        for key, value, source in rows:
            _print(f"{key.ljust(width)}  {json.dumps(value, ensure_ascii=False):<40}  {source}")
        if generation_config is None:
            _print("(the model is not available locally: generation_config.json values are not shown)")


def _generation_config_of(model: str | None) -> dict[str, Any] | None:
    try:
        if model is None:
            from llmcli.models.resolve import default_model_spec

            model = default_model_spec()
            if model.endswith(".gguf"):
                return {}
        folder = _local_folder(model)[0]
    except LlmcliError:
        return None
    try:
        return json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}

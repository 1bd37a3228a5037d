"""A chat in progress: turns, slash commands, and what each turn cost. No terminal code.

The session drives a target's chat history (in-process: exact ids and a KV cache; through a
server: messages re-sent) and reports through a `ChatView`, so the interactive REPL and scripted
chat (stdin not a terminal), local or remote, share every rule: nothing the user typed is lost,
a failed or interrupted turn leaves the chat consistent, the cache is reused.
"""

from __future__ import annotations

import difflib
import json
import shlex
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llmcli.config.declare import declarations, field_types
from llmcli.config.escapes import unescape
from llmcli.config.settings import SPECULATIVE_METHODS, THINK_MODES, PromptSettings, SamplingSettings
from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.errors import LlmcliError, UsageError
from llmcli.frontends.attachments import dropped_image_path
from llmcli.frontends.formats import format_command, unfinished_value
from llmcli.frontends.functions import describe_call
from llmcli.frontends.target import Outcome, known
from llmcli.frontends.tools import call_record
from llmcli.frontends.transcript import TRANSCRIPT_VERSION, read_transcript, write_transcript
from llmcli.frontends.wording import plural
from llmcli.server.client import StreamBrokenError

if TYPE_CHECKING:  # torch-free at import: a chat through a server never loads it
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolCall, ToolRequest
    from llmcli.frontends.functions import Functions
    from llmcli.frontends.protocols import ChatHistory, Target
    from llmcli.models.vision.encoder import ImageInput

LENGTH_CUT = "cut by the token limit (/set max_new_tokens N for longer replies)"
CUT = ("interrupted", "error")  # replies kept as far as they came: Ctrl-C, a server that stopped
MOST_TOOL_ROUNDS = 8  # replies that call tools, in one exchange, before one must answer
# What ChatView.approve answers for Ctrl-C and Ctrl-D: not a "no" (the model would be asked again,
# and may call again, prompt after prompt), but a way out: of this round of calls, or of the chat.
STOP_ROUND = "stop"
END_CHAT = "end"
# What /set may change: every sampling setting.
SETTABLE = tuple(declarations(SamplingSettings))
HELP = f"""\
/help                 this list
/system [TEXT | -]    show, set (or with "-" clear) the system prompt
/set KEY VALUE        {", ".join(SETTABLE)}
                      ("none" unsets seed and stop); speculative off|lookup|draft|mtp; think_budget N
/show                 settings, model, device, context used
/stats                the last reply's timings, and the session's totals
/reset                clear the conversation and its cache
/undo                 drop the last exchange (or the image attached last)
/image PATH           attach an image to your next message (a path pasted alone does too)
/retry                generate the last reply again
/format [json | schema FILE | off]
                      replies as JSON (an object), or JSON valid under a schema; off: text
/think show|hide|off  a reasoning model's thinking: shown dimmed, hidden, or not done
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
    "/image",
    "/retry",
    "/format",
    "/think",
    "/save",
    "/load",
    "/exit",
)
ALIASES = {"/quit": "/exit", "/?": "/help", "/clear": "/reset"}


class ChatView(Protocol):
    def tool_call(self, text: str) -> None: ...
    def approve(self, name: str) -> str | None:
        """y, n or a (always this function, this session); STOP_ROUND (Ctrl-C) or END_CHAT
        (Ctrl-D); None where nobody can be asked."""
        ...

    def tool_result(self, text: str) -> None: ...
    def reply_start(self) -> None: ...
    def reasoning_piece(self, text: str) -> None: ...
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
    prefilled_tokens: int | None  # None (null in --json): not known (a reply through a server cut
    cached_tokens: int | None  # by Ctrl-C gets no usage; another server reports no timings)
    completion_tokens: int
    ttft_s: float
    prefill_tok_s: float | None
    decode_tok_s: float | None
    finish_reason: str
    context_used: int
    context_length: int
    dropped_exchanges: int
    speculative: dict[str, Any] | None = None  # method, drafted, accepted
    reasoning: str | None = None  # a reasoning model's thinking (the reply is the answer alone)
    reasoning_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # id, name, arguments, result
    image_tokens: int | None = None  # of prompt_tokens, those the chat's images take (None: not known)

    @classmethod
    def of(cls, outcome: Outcome, context_used: int, context_length: int, dropped: int) -> TurnReport:
        prompt_tokens, cached = outcome.prompt_tokens, outcome.cached_tokens
        prefilled = outcome.prefilled_tokens
        if prefilled is None and prompt_tokens is not None:
            prefilled = prompt_tokens - (cached or 0)
        return cls(
            reply=outcome.text,
            prompt_tokens=prompt_tokens or 0,
            prefilled_tokens=prefilled,
            cached_tokens=cached,
            completion_tokens=outcome.completion_tokens or 0,
            ttft_s=round(outcome.ttft_s or 0.0, 6),
            prefill_tok_s=_rounded(outcome.prefill_tok_s),
            decode_tok_s=_rounded(outcome.decode_tok_s),
            finish_reason=outcome.finish_reason,
            image_tokens=outcome.image_tokens,
            context_used=context_used,
            context_length=context_length,
            dropped_exchanges=dropped,
            speculative=outcome.speculative,
            reasoning=outcome.reasoning,
            reasoning_tokens=outcome.reasoning_tokens,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def line(self) -> str:
        interrupted = {
            "interrupted": " · interrupted",
            "error": " · cut short",
            "length": f" · {LENGTH_CUT}",
        }.get(self.finish_reason, "")
        figures = [
            f"TTFT {self.ttft_s:.2f} s",
            *known("{:.1f} tok/s", self.decode_tok_s),  # what is not known is left out, not 0
            *known("prefilled {}", self.prefilled_tokens),
            *known("reused {}", self.cached_tokens),
            f"context {self.context_used}/{self.context_length}",
        ]
        return " · ".join(figures) + f"{speculative_note(self.speculative)}{interrupted}"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


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
        self.prefilled_tokens += report.prefilled_tokens or 0
        self.cached_tokens += report.cached_tokens or 0
        self.completion_tokens += report.completion_tokens
        self.drafted += (report.speculative or {}).get("drafted", 0)
        self.accepted += (report.speculative or {}).get("accepted", 0)

    def stats_text(self, last: TurnReport, speculative: str) -> str:
        """/stats: the last reply's timings, then the session's totals."""
        text = (
            f"last reply: {plural(last.completion_tokens, 'token')} ({last.finish_reason}) · "
            + " · ".join(
                [
                    f"TTFT {last.ttft_s:.3f} s",
                    *known(f"prefill {plural(last.prefilled_tokens or 0, 'token')}", last.prefilled_tokens),
                    *known("prefill at {:.1f} tok/s", last.prefill_tok_s),
                    *known("reused {}", last.cached_tokens),
                    *known("decode {:.1f} tok/s", last.decode_tok_s),
                ]
            )
            + "\n"
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
    """A chat over any target: every /command exists once, here; what a target cannot do, it
    refuses in one line."""

    def __init__(
        self,
        target: Target,
        view: ChatView,
        *,
        sampling: SamplingSettings | None = None,
        system: str | None = None,
        speculative: str = "off",
        output: OutputFormat | None = None,
        think: str = "show",
        think_budget: int | None = None,
        functions: Functions | None = None,
    ) -> None:
        self.target = target
        self.view = view
        # The values given (flags, env, config, /set); the target fills in the rest: the model's
        # own defaults in-process, the server's defaults through one.
        self.sampling = sampling or SamplingSettings()
        self.output = output  # /format: replies constrained to JSON (a schema's, or any object)
        self.speculative = "off"
        if speculative != "off":
            self.set_speculative(speculative)
        self.history: ChatHistory = target.chat(system)
        self.think = think  # show, hide, off (/think)
        self.history.think_off = think == "off"
        self.history.think_budget = think_budget
        self.functions = functions  # chat --functions: tools the replies may call
        self.history.tools = functions.request(0, False) if functions else None
        self.last_turn: TurnReport | None = None
        # Images attached for the next message (/image, or a path pasted alone): sent with it,
        # kept if its turn fails, taken back one by one by /undo.
        self.attached: list[ImageInput] = []
        self.totals = SessionTotals()
        # Any turn or command that ended in an error, for scripted exit codes (an MCP server that
        # did not start too: said before the chat began).
        self.failed = functions is not None and functions.failed
        self.ended = False  # Ctrl-D at a call's approval: the chat ends after this turn
        if target.caveat:
            view.notice(target.caveat)

    @property
    def context_length(self) -> int:
        return self.target.context_length

    # Turns ------------------------------------------------------------------------------------

    def turn(self, user_text: str | list[dict[str, Any]]) -> TurnReport | None:
        """One exchange: the user's message, then replies until one calls no tool (with
        --functions, each call is run or declined and its result read by the next). On any
        failure the conversation is as it was before, and usable."""
        history, steps = self.history, []
        path = dropped_image_path(user_text) if isinstance(user_text, str) else None
        if path is not None:
            self._attach(path)
            return None
        if self.attached and isinstance(user_text, str):
            images = [{"type": "image", "image": image} for image in self.attached]
            user_text = [*images, {"type": "text", "text": user_text}]
        if self.functions:  # an MCP server gone since the last turn took its tools with it
            history.tools = self.functions.request(0, False)
        for round_ in range(MOST_TOOL_ROUNDS + 1):
            tools = self.functions.request(round_, round_ == MOST_TOOL_ROUNDS) if self.functions else None
            asked = self._reply(user_text, steps, tools)
            if asked is None:
                return None
            outcome, dropped = asked
            if not outcome.tool_calls or outcome.finish_reason in CUT:
                break
            try:
                results = [self._run_call(call) for call in outcome.tool_calls]
            except _RoundStopped as stop:  # kept as a reply cut by Ctrl-C: no call of it answered
                self.ended = stop.end_chat
                outcome.finish_reason = "interrupted"
                break
            history.step(outcome)
            steps.append(
                {
                    "role": "assistant",
                    "content": outcome.text,
                    "tool_calls": [c.openai() for c in outcome.tool_calls],
                }
            )
            steps += [
                {"role": "tool", "tool_call_id": c.id, "content": r}
                for c, r in zip(outcome.tool_calls, results, strict=True)
            ]
            self._report(outcome, dropped, results)
        history.commit(outcome, steps)
        self.attached = []  # sent, and kept in the conversation
        report = self._report(outcome, dropped, [])
        if self.output is not None and outcome.finish_reason not in CUT and not outcome.value_complete:
            limit = (outcome.sampling or {}).get("max_new_tokens") or self.sampling.max_new_tokens
            tokens = outcome.completion_tokens
            self._fail(unfinished_value(self.output, outcome.finish_reason, tokens, limit, text=outcome.text))
        return report

    def _reply(
        self, user_text: str | list[dict[str, Any]], steps: list[dict[str, Any]], tools: ToolRequest | None
    ) -> tuple[Outcome, int] | None:
        """One reply, streamed to the view: its outcome and how many exchanges were dropped to
        fit, or None when it failed (said already, the conversation as before)."""
        history = self.history
        try:
            dropped = history.prepare(user_text, self.sampling, steps)
            if dropped:
                self.view.notice(
                    f"Context full: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit "
                    f"({history.pending_tokens} of {self.context_length} tokens); the system prompt stays."
                )
            reply = history.ask(self.sampling, self.speculative, self.output, tools)
        except LlmcliError as error:
            history.abandon(error)
            self._fail(error.one_line())
            return None
        self.view.reply_start()
        try:
            for channel, piece in reply:
                if channel == REASONING:
                    if self.think == "show":
                        self.view.reasoning_piece(piece)
                elif channel == CONTENT:
                    self.view.reply_piece(piece)
        except KeyboardInterrupt:
            reply.interrupt()  # keep what was generated; the cache matches it again
        except StreamBrokenError as error:  # the server stopped mid-reply: keep what came, cut
            self._fail(error.one_line())
            outcome = reply.outcome()
            outcome.finish_reason = "error"  # kept as a cut reply, as after Ctrl-C
            return outcome, dropped
        except Exception as error:  # out of memory and the like: this turn is lost, the chat is not
            self._fail(history.abandon(error) or _failure(error))
            return None
        return reply.outcome(), dropped

    def _report(self, outcome: Outcome, dropped: int, results: list[str]) -> TurnReport:
        report = TurnReport.of(outcome, self.history.context_used, self.context_length, dropped)
        report.tool_calls = [
            {**call_record(call), "result": result}
            for call, result in zip(outcome.tool_calls, results, strict=False)
        ]
        self.last_turn = report
        self.totals.add(report)
        self.view.reply_end(outcome, report)
        return report

    def _run_call(self, call: ToolCall) -> str:
        """Run a call the user approves (or --yes did); what the model reads about it."""
        functions = self.functions
        assert functions is not None
        self.view.tool_call(describe_call(call))
        if not functions.offers(call.name):  # never asked about, never run: not a tool offered
            self.view.tool_result(f"not run ({call.name} is not one of the functions offered)")
            return functions.refusal(call.name)
        answer = "y" if functions.approved_without_asking(call) else self.view.approve(call.name)
        if answer in (STOP_ROUND, END_CHAT):
            self.view.tool_result(
                "not run (Ctrl-D: the chat ends)"
                if answer == END_CHAT
                else "not run (Ctrl-C: no more calls this turn)"
            )
            raise _RoundStopped(end_chat=answer == END_CHAT)
        if answer == "a":
            functions.always.add(call.name)
        if answer not in ("y", "a"):
            why = (
                "no terminal to ask on: start chat with --yes to run calls" if answer is None else "declined"
            )
            self.view.tool_result(f"not run ({why})")
            return "The user did not allow this call to run."
        try:
            result = functions.run(call)
        except KeyboardInterrupt:  # as at the approval: this round of calls ends, the chat goes on
            self.view.tool_result("interrupted (Ctrl-C: no more calls this turn)")
            raise _RoundStopped(end_chat=False) from None
        finally:
            self.failed |= functions.failed  # a server that stopped during the call: said already
        self.view.tool_result(result)
        return result

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
        if handler is None and (path := dropped_image_path(line)) is not None:
            try:  # an image's path dropped on the prompt (it starts with "/" too)
                self._attach(path)
            except LlmcliError as error:
                self._fail(error.one_line())
            return True
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
            self.view.info(f"system prompt: {self.history.system or '(none)'}")
            return
        self.history.set_system(None if text == "-" else text)
        self.view.info("system prompt cleared" if text == "-" else "system prompt set")

    def set_speculative(self, method: str) -> None:
        if method not in SPECULATIVE_METHODS:
            raise UsageError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        self.target.speculation(method)
        self.speculative = method

    def _cmd_set(self, argument: str) -> None:
        key, _, value = argument.partition(" ")
        key, value = key.strip().replace("-", "_"), value.strip()
        if key == "speculative" and value:
            self.set_speculative(value)
            self.view.info(f"speculative = {value}")
            return
        if key == "think_budget" and value:
            self.history.think_budget = None if value == "none" else _think_budget(value)
            self.view.info(f"think_budget = {shown(self.history.think_budget)}")
            return
        keys = (*SETTABLE, "speculative", "think_budget")
        if key and key not in keys:
            import difflib

            close = [k for k in keys if k.startswith(key)] or difflib.get_close_matches(key, keys, n=2)
            hint = f" — did you mean {' or '.join(close)}?" if close else f" (one of {', '.join(keys)})"
            raise UsageError(f"no setting {key!r} for /set{hint}")
        if not value:
            raise UsageError(f"usage: /set KEY VALUE, with KEY one of {', '.join(keys)}")
        self.sampling = apply_setting(self.sampling, key, value)
        self.view.info(f"{key} = {shown(getattr(self.sampling, key))}")

    def _cmd_think(self, argument: str) -> None:
        if argument not in THINK_MODES:
            raise UsageError(f"usage: /think {' | '.join(THINK_MODES)} (now {self.think})")
        self.think = argument
        self.history.think_off = argument == "off"
        self.view.info(f"think {argument}")

    def _cmd_format(self, argument: str) -> None:
        output = format_command(argument, self.output)
        if output is not None and self.functions is not None:
            raise UsageError(
                "/format and tools (--functions, --mcp) do not combine: a reply may call a tool or be "
                "JSON, not both"
            )
        self.output = output
        self.view.info(f"format {_format_name(self.output) if self.output else 'off (text)'}")

    def _cmd_show(self, _: str) -> None:
        target = self.target
        values = target.shown_sampling(self.sampling)
        settings = " · ".join(f"{k} {shown(v)}" for k, v in values.items()) or "the server's"
        self.view.info(
            f"model {target.name} · {target.summary()} · speculative {self.speculative}\n"
            f"{self.history.describe()}\n"
            f"system {self.history.system or '(none)'}\nsampling: {settings}"
        )

    def _cmd_stats(self, _: str) -> None:
        if self.last_turn is None:
            self.view.info("no reply yet")
            return
        self.view.info(self.totals.stats_text(self.last_turn, self.speculative))

    def _cmd_reset(self, _: str) -> None:
        self.history.reset()
        self.view.info("conversation cleared")

    def _cmd_image(self, argument: str) -> None:
        self._attach(_one_path(argument, "/image PATH"))

    def _attach(self, path: Path) -> None:
        """Read and check the image now (a bad one is refused at once, naming it); it goes
        with the next message."""
        from llmcli.models.vision.image_file import open_image, read_image_file

        refusal = self.target.image_refusal()
        if refusal is not None:
            raise UsageError(f"image {path}: {refusal}")
        image = read_image_file(path)
        checked = open_image(image)
        self.attached.append(image)
        count = f", {len(self.attached)} images" if len(self.attached) > 1 else ""
        self.view.info(
            f"attached {path} ({checked.width}×{checked.height}{count}): it goes with your next "
            "message · /undo takes it back"
        )

    def _cmd_undo(self, _: str) -> None:
        if self.attached:
            image = self.attached.pop()
            self.view.info(f"took back the image {image.label}")
            return
        dropped = self.history.undo()
        if dropped is None:
            self.view.info("nothing to undo")
            return
        self.view.info(f"dropped: {_preview(dropped[0])}")

    def _cmd_retry(self, _: str) -> None:
        last = self.history.undo(keep_cache=True)
        if last is None:
            self.view.info("nothing to retry")
            return
        if self.turn(last[0]) is None:
            self.history.restore(*last)  # the new attempt failed: put the previous reply back

    def _cmd_save(self, argument: str) -> None:
        path = _one_path(argument, "/save FILE")
        settings = self.target.shown_sampling(self.sampling)
        data = {
            "version": TRANSCRIPT_VERSION,
            "model": self.target.name,
            "system": self.history.system,
            "settings": {key: list(v) if isinstance(v, tuple) else v for key, v in settings.items()},
            "messages": self.history.messages,
        }
        write_transcript(path, data)
        self.view.info(f"saved {len(self.history.messages)} messages to {path}")

    def _cmd_load(self, argument: str) -> None:
        path = _one_path(argument, "/load FILE")
        transcript = read_transcript(path, SETTABLE)
        messages = transcript.messages
        sampling = self.sampling
        for key, value in transcript.settings.items():  # a null seed or an empty stop list unsets it
            try:
                sampling = apply_setting(sampling, key, value)
            except LlmcliError as error:
                raise UsageError(f"{path}: settings.{key}: {error.message}") from None
        note = self.history.replace(transcript.system, messages, sampling, str(path))
        changes = settings_changed(
            self.target.shown_sampling(self.sampling), self.target.shown_sampling(sampling)
        )
        self.sampling = sampling
        self.view.info(f"loaded {len(messages)} messages from {path}{note}")
        if changes:
            self.view.notice(f"{path} brought its own settings: {changes}")


class _RoundStopped(Exception):
    """Ctrl-C at a call's approval ends this round of calls and the turn; Ctrl-D the chat too."""

    def __init__(self, end_chat: bool) -> None:
        super().__init__()
        self.end_chat = end_chat


def settings_changed(before: dict[str, Any], after: dict[str, Any]) -> str:
    """ "temperature 0.2 → 0.8 · seed none → 7": what a /load replaced (empty: nothing)."""
    return " · ".join(
        f"{key} {shown(before.get(key))} → {shown(after.get(key))}"
        for key in SETTABLE
        if before.get(key) != after.get(key)
    )


def apply_setting(sampling: SamplingSettings, key: str, value: Any) -> SamplingSettings:
    """One /set (or a loaded transcript's setting), checked by the same rules as the flags."""
    if key == "stop":
        stops: tuple[str, ...] = (
            ()
            if value in ("none", None)
            else (tuple(value) if isinstance(value, list) else tuple(map(unescape, shlex.split(str(value)))))
        )
        return replace(sampling, stop=SamplingSettings(stop=stops).validate().stop)
    if key == "seed" and value in ("none", None):
        return replace(sampling, seed=None)
    kind = field_types(SamplingSettings)[key]
    try:
        typed = kind(value)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"{key} needs {'an integer' if kind is int else 'a number'}, got {value!r}"
        ) from error
    SamplingSettings(**{key: typed}).validate()
    return replace(sampling, **{key: typed})


def _format_name(output: OutputFormat) -> str:
    """What /format says is in force, in its own words: "json", "schema FILE"."""
    return output.label.removeprefix("--format ").replace("--json-schema", "schema", 1)


def _failure(error: Exception) -> str:
    """A failed reply in one line: an llmcli error's own words, else the exception's."""
    if isinstance(error, LlmcliError):
        return error.one_line()
    return f"the reply failed: {type(error).__name__}: {error}".splitlines()[0]


def _think_budget(value: str) -> int:
    try:
        budget = int(value)
    except ValueError:
        raise UsageError(f"think_budget needs an integer (or none), got {value!r}") from None
    PromptSettings(think_budget=budget).validate("request")
    return budget


def _one_path(argument: str, usage: str) -> Path:
    if not argument:
        raise UsageError(f"usage: {usage}")
    return Path(argument)


def _preview(text: str | list[dict[str, Any]], width: int = 60) -> str:
    if isinstance(text, list):  # a message with images: its text, each image as [image]
        text = " ".join(part.get("text", "[image]") for part in text)
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"

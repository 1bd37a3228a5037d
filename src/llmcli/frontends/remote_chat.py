"""`llmcli chat` through a server: the same REPL, commands and views, with the model elsewhere.

The conversation is kept here as messages and re-sent whole each turn, as every OpenAI client
does; llmcli's server then prefills only what its cache does not hold (the `reused` figure), and
any other server does whatever it does. What only an in-process model can give degrades with a
note: no exact token ids, so `/undo` cannot crop a cache here (the server re-reads the chat), and
another kind of server reports only its `usage`, not llmcli's timings.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from llmcli.config.settings import SPECULATIVE_METHODS, SamplingParams, SamplingSettings, SpeculativeSettings
from llmcli.engine.conversation import TRANSCRIPT_VERSION, read_transcript, write_transcript
from llmcli.engine.structured import OutputFormat, format_command
from llmcli.errors import LlmcliError, UsageError
from llmcli.frontends.chat_session import (
    ALIASES,
    COMMANDS,
    HELP,
    SETTABLE,
    ChatView,
    SessionTotals,
    TurnReport,
    apply_setting,
    plural,
    settings_changed,
    shown,
)
from llmcli.frontends.remote import Target, parsed_value, request_body


@dataclass
class RemoteResult:
    """What the views get at the end of a reply (the in-process GenerationResult's shape)."""

    text: str
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)


class RemoteChatSession:
    def __init__(
        self,
        target: Target,
        sampling: SamplingSettings,
        view: ChatView,
        *,
        system: str | None,
        speculative: SpeculativeSettings | None = None,
        output: OutputFormat | None = None,
    ) -> None:
        self.target = target
        self.view = view
        self.system = system
        self.messages: list[dict[str, str]] = []
        # Values given here (flags, env, config, /set) are sent; the rest are the server's defaults.
        given = {
            name: getattr(sampling, name) for name in SETTABLE if getattr(sampling, name) not in (None, ())
        }
        self.explicit = set(given)
        self.params = SamplingParams(**given)
        info = target.info or {}
        self.context_length = int(info.get("context_length") or 0)
        self.loaded = SimpleNamespace(
            name=target.model, device=target.client.url, dtype_name=info.get("dtype") or "remote"
        )
        self.last_turn: TurnReport | None = None
        self.totals = SessionTotals()
        self.failed = False
        self.speculative = speculative  # sent per request to an llmcli server
        self.output: OutputFormat | None = output  # /format: sent as response_format
        if target.info is None:
            view.notice(
                f"{target.client.url} is not an llmcli server: timings are its usage counts only, "
                "and /undo re-sends the chat rather than cropping a cache."
            )

    def _sampling(self) -> SamplingSettings:
        values = {name: getattr(self.params, name) for name in self.explicit}
        return SamplingSettings(**values)

    def _all_messages(self, user_text: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.messages, {"role": "user", "content": user_text}]

    def turn(self, user_text: str) -> TurnReport | None:
        body = request_body(self.target, self._sampling(), self.speculative, self.output)
        body["messages"] = self._all_messages(user_text)
        pieces: list[str] = []
        finish, usage, timings = "stop", {}, {}
        self.view.reply_start()
        events = self.target.client.stream("chat/completions", body)
        try:
            for event in events:
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        pieces.append(piece)
                        self.view.reply_piece(piece)
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
        except KeyboardInterrupt:
            finish = "interrupted"  # keep what arrived; closing the stream stops the server
        except LlmcliError as error:
            events.close()
            self._fail(error.one_line())
            return None
        finally:
            events.close()
        text = "".join(pieces)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or len(pieces))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        report = TurnReport(
            reply=text,
            prompt_tokens=prompt_tokens,
            prefilled_tokens=int(timings.get("prefilled_tokens", prompt_tokens - cached)),
            cached_tokens=cached,
            completion_tokens=completion_tokens,
            ttft_s=float(timings.get("ttft_s") or 0.0),
            prefill_tok_s=float(timings.get("prefill_tok_s") or 0.0),
            decode_tok_s=float(timings.get("decode_tok_s") or 0.0),
            finish_reason=finish,
            context_used=prompt_tokens + completion_tokens,
            context_length=self.context_length,
            dropped_exchanges=0,
            speculative=timings.get("speculative"),
        )
        self.last_turn = report
        self.totals.add(report)
        self.view.reply_end(RemoteResult(text, finish), report)
        if self.output is not None and finish != "interrupted" and not parsed_value(text)[0]:
            cause = "the token limit cut it" if finish == "length" else f"the server ended it ({finish})"
            self._fail(f"the reply is not a complete JSON value ({self.output.label}): {cause}")
        return report

    def _fail(self, message: str) -> None:
        self.failed = True
        self.view.error(message)

    def command(self, line: str) -> bool:
        name, _, argument = line.strip().partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        handler = getattr(self, f"_cmd_{name[1:]}", None) if name in COMMANDS else None
        if handler is None:
            close = difflib.get_close_matches(name, COMMANDS + tuple(ALIASES), n=1, cutoff=0.5)
            hint = f" — did you mean {close[0]}?" if close else ""
            self._fail(f"unknown command {name}{hint} (/help lists them)")
            return True
        try:
            return handler(argument.strip()) is not False
        except LlmcliError as error:
            self._fail(error.one_line())
            return True

    def _cmd_help(self, _: str) -> None:
        self.view.info(HELP)

    def _cmd_exit(self, _: str) -> bool:
        return False

    def _cmd_system(self, text: str) -> None:
        if not text:
            self.view.info(f"system prompt: {self.system or '(none)'}")
            return
        self.system = None if text == "-" else text
        self.view.info("system prompt cleared" if text == "-" else "system prompt set")

    def _cmd_set(self, argument: str) -> None:
        key, _, value = argument.partition(" ")
        key, value = key.strip().replace("-", "_"), value.strip()
        if key == "speculative" and value:
            if value not in SPECULATIVE_METHODS:
                known = ", ".join(SPECULATIVE_METHODS)
                raise UsageError(f"speculative must be one of {known}, got {value!r}")
            if self.target.info is None:
                url = self.target.client.url
                raise UsageError(f"{url} is not an llmcli server: it drafts as it was started")
            draft_model = self.speculative.draft_model if self.speculative else None
            self.speculative = SpeculativeSettings(method=value, draft_model=draft_model)
            self.view.info(f"speculative = {value}")
            return
        if key not in SETTABLE or not value:
            raise UsageError(f"usage: /set KEY VALUE, with KEY one of {', '.join(SETTABLE)}, speculative")
        self.params = apply_setting(self.params, key, value)
        self.explicit.add(key)
        self.view.info(f"{key} = {shown(getattr(self.params, key))}")

    def _cmd_format(self, argument: str) -> None:
        self.output = format_command(argument, self.output)
        self.view.info(f"format {self.output.label if self.output else 'off (text)'}")

    def _cmd_show(self, _: str) -> None:
        sent = " · ".join(f"{k} {shown(getattr(self.params, k))}" for k in sorted(self.explicit))
        sent = sent or "the server's"
        self.view.info(
            f"model {self.target.model} · server {self.target.client.url}\n"
            f"{plural(len(self.messages) // 2, 'exchange')} · "
            f"context {self.context_length or 'unknown'} tokens\n"
            f"system {self.system or '(none)'}\nsampling: {sent}"
        )

    def _cmd_stats(self, _: str) -> None:
        if self.last_turn is None:
            self.view.info("no reply yet")
            return
        method = self.speculative.method if self.speculative else "off"
        self.view.info(self.totals.stats_text(self.last_turn, method))

    def _cmd_reset(self, _: str) -> None:
        self.messages = []
        self.view.info("conversation cleared")

    def _cmd_undo(self, _: str) -> None:
        if not self.messages:
            self.view.info("nothing to undo")
            return
        user = self.messages[-2]["content"]
        self.messages = self.messages[:-2]
        self.view.info(f"dropped: {' '.join(user.split())[:60]}")

    def _cmd_retry(self, _: str) -> None:
        if not self.messages:
            self.view.info("nothing to retry")
            return
        previous = self.messages[-2:]
        self.messages = self.messages[:-2]
        if self.turn(previous[0]["content"]) is None:
            self.messages += previous  # the new attempt failed: nothing is lost

    def _cmd_save(self, argument: str) -> None:
        path = _path(argument, "/save FILE")
        settings = {k: list(v) if k == "stop" else v for k, v in self.params.as_dict().items()}
        data = {  # the in-process chat's transcript format: either can load the other's
            "version": TRANSCRIPT_VERSION,
            "model": self.target.model,
            "system": self.system,
            "settings": settings,
            "messages": self.messages,
        }
        write_transcript(path, data)
        self.view.info(f"saved {len(self.messages)} messages to {path}")

    def _cmd_load(self, argument: str) -> None:
        path = _path(argument, "/load FILE")
        data = read_transcript(path)
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict)
            and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise LlmcliError(f"{path} is not an llmcli chat transcript")
        before = self.params
        for key, value in (data.get("settings") or {}).items():
            if key in SETTABLE and value not in (None, []):
                self.params = apply_setting(self.params, key, value)
                self.explicit.add(key)
        self.system = data.get("system") if isinstance(data.get("system"), str) else self.system
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.view.info(f"loaded {len(self.messages)} messages from {path}")
        changes = settings_changed(before, self.params)
        if changes:
            self.view.notice(f"{path} brought its own settings: {changes}")


def _path(argument: str, usage: str) -> Path:
    if not argument:
        raise UsageError(f"usage: {usage}")
    return Path(argument)

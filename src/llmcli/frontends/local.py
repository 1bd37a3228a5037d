"""The in-process target: a model loaded here, its engine, and a chat's exact token ids.

The chat keeps the token ids the model saw (its own sampled ones included) and the engine's KV
cache holds them, so each turn prefills only its new tokens, /undo crops the cache, and an
interrupted or failed reply leaves the cache exactly as the conversation says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import LoadSettings, SamplingParams, SamplingSettings, SpeculativeSettings
from llmcli.engine.reasoning import CONTENT, thinking_of
from llmcli.errors import LlmcliError, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.loading import engine_with_feedback, speculation_with_feedback
from llmcli.frontends.target import Ask, Outcome
from llmcli.models.cpu_kernels import which_on

if TYPE_CHECKING:
    from llmcli.engine.image_rows import ImageTable
    from llmcli.engine.loop import Engine, Generation, GenerationResult
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.structured.constraint import Constraint
    from llmcli.engine.tools import ToolRequest
    from llmcli.engine.tools.reader import ToolCallReader
    from llmcli.engine.tools.turn import ToolTurn
    from llmcli.models.load import LoadedModel


class InProcessTarget:
    def __init__(
        self,
        loaded: LoadedModel,
        model_spec: str | None,
        load: LoadSettings,
        speculative: SpeculativeSettings | None = None,
    ) -> None:
        self.loaded = loaded
        self.name = loaded.name
        self.where = str(loaded.device)
        self.dtype_name = loaded.dtype_name
        self.context_length = loaded.context_length
        self._model_spec = model_spec
        self._load = load
        self._speculative = speculative or SpeculativeSettings()
        # Each method's speculation made once (a draft model loads once), and kept.
        self._speculations: dict[str, Speculation | None] = {"off": None}
        self._beams = False  # a beam search ran: transformers' generate, not the engine
        self.caveat = None  # nothing an in-process chat cannot do

    @cached_property
    def engine(self) -> Engine:
        """Made when first needed: beam search runs on the model itself and needs none. Its
        prompts' state is kept on disk for the next process (frontends/prompt_cache.py)."""
        from llmcli.frontends.prompt_cache import attach_disk_cache

        engine = engine_with_feedback(self.loaded)
        attach_disk_cache(engine, self.loaded, self._load)
        return engine

    @property
    def engine_name(self) -> str:
        return "transformers (beam search)" if self._beams else self.engine.name

    def facts(self) -> dict[str, Any]:
        loaded = self.loaded
        return {
            "weight_bytes": loaded.weight_bytes,
            "device": str(loaded.device),
            "dtype": loaded.dtype_name,
            "quant": loaded.quant,
            "quant_backend": loaded.quant_backend,
            "cpu_kernels": which_on(loaded.device, loaded.quant),
            "engine": self.engine_name,
            "kv_bytes_per_token": loaded.kv_bytes_per_token,
            "context_length": loaded.context_length,
        }

    def summary(self) -> str:
        return f"{self.loaded.memory_summary()} · engine {self.engine_name}"

    def params(self, sampling: SamplingSettings) -> SamplingParams:
        return sampling.resolve(self.loaded.generation_config)

    def shown_sampling(self, sampling: SamplingSettings) -> dict[str, Any]:
        return self.params(sampling).as_dict()

    def speculation(self, method: str) -> Speculation | None:
        if method not in self._speculations:
            if method == "draft" and not self._speculative.draft_model:
                raise UsageError("drafting needs a draft model: start chat with --draft-model MODEL or self")
            settings = dataclasses.replace(self._speculative, method=method).validate()
            self._speculations[method] = speculation_with_feedback(
                self.loaded, self._model_spec, settings, self._load, self.engine
            )
        return self._speculations[method]

    def constraint(self, output: OutputFormat | None) -> Constraint | None:
        if output is None:
            return None
        from llmcli.engine.structured.constraint import Constraint

        loaded = self.loaded
        return Constraint(output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    def reply(self, ask: Ask) -> LocalReply | BeamReply:
        from llmcli.engine.conversation import prompt_ids

        tokenizer, messages, output = self.loaded.tokenizer, ask.messages, ask.output
        options, turn = None, None
        if ask.tools is not None:
            turn = self.tool_turn(messages, ask.tools)
            messages, options, output = turn.messages, turn.options, turn.output
        ids = prompt_ids(
            tokenizer,
            messages,
            raw=ask.raw,
            think_off=ask.think_off,
            options=options,
            context_length=self.loaded.context_length,
            images=self.images(messages),
        )
        params = self.params(ask.sampling)
        if ask.num_beams > 1:
            self._beams = True
            return BeamReply(self.loaded, ids, params, ask.num_beams)
        return self.generate(ids, params, ask.speculative, output, ask.think_budget, turn)

    def images(self, messages: list[dict[str, Any]]) -> ImageTable | None:
        """The model's table of images where its messages hold images it can read; a clear
        refusal where they hold images it cannot."""
        from llmcli.engine.image_rows import table_of
        from llmcli.engine.prompt_images import images_in, refuse_images

        if not images_in(messages):
            return None
        refusal = self.image_refusal()
        if refusal is not None:
            refuse_images(messages, refusal)
        return table_of(self.loaded)

    def image_refusal(self) -> str | None:
        if self.loaded.vision is None:
            return f"{self.name} reads text only"
        if self.engine.name != "native":
            return "images are read on the native engine only, and this model runs on transformers"
        return None

    def tool_turn(self, messages: list[dict[str, Any]], tools: ToolRequest | None) -> ToolTurn:
        from llmcli.engine.tools.turn import tool_turn

        loaded = self.loaded
        return tool_turn(loaded.tokenizer, messages, tools, loaded.vocab_size, loaded.eos_token_ids)

    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        speculative: str,
        output: OutputFormat | None,
        think_budget: int | None = None,
        tools: ToolTurn | None = None,
    ) -> LocalReply:
        if speculative in ("draft", "mtp") and any(token < 0 for token in ids):
            raise UsageError(
                f"--speculative {speculative} drafts from the prompt's tokens, and an image is none: "
                "use lookup or off with an image"
            )
        self.engine.speculation = self.speculation(speculative)
        tokenizer = self.loaded.tokenizer
        if think_budget is not None and thinking_of(tokenizer) is None:
            raise UsageError(
                f"a thinking budget needs a model that thinks, and {self.name}'s template and "
                "tokenizer mark no thinking"
            )
        reader = tools.reader() if tools is not None else None
        generation = self.engine.generate(
            ids, params, tokenizer, self.constraint(output), think_budget, keep_special=reader is not None
        )
        return LocalReply(generation, params, tokenizer, ids, reader)

    def chat(self, system: str | None) -> LocalHistory:
        return LocalHistory(self, system)


def outcome_of(result: GenerationResult, params: SamplingParams) -> Outcome:
    stats = result.stats
    return Outcome(
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        prefilled_tokens=stats.prefilled_tokens,
        cached_tokens=stats.cached_tokens,
        cached_from=stats.cached_from,
        ttft_s=stats.ttft_s,
        prefill_tok_s=stats.prefill_tok_s,
        decode_tok_s=stats.decode_tok_s,
        speculative=stats.speculative.as_dict() if stats.speculative else None,
        sampling=params.as_dict(),
        value_complete=result.value_complete,
        token_ids=list(result.token_ids),
    )


class LocalReply:
    """A generation's text, split into thinking, answer and tool calls (engine/reply.py)."""

    def __init__(
        self,
        generation: Generation,
        params: SamplingParams,
        tokenizer: Any,
        prompt: list[int],
        reader: ToolCallReader | None = None,
    ) -> None:
        from llmcli.engine.reply import ReplyStream

        self.generation = generation
        self.params = params
        self.stream = ReplyStream(tokenizer, prompt, reader)
        # The tokens the prompt's images take (their rows' markers: engine/image_markers.py).
        self.image_tokens = sum(token < 0 for token in prompt)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.stream.split(self.generation)

    def interrupt(self) -> None:
        self.generation.interrupt()

    def outcome(self) -> Outcome:
        outcome = outcome_of(self.generation.result, self.params)
        raw = outcome.text
        answer, reasoning, tokens, calls = self.stream.summary(self.generation.result)
        outcome.text, outcome.tool_calls = answer, calls
        if reasoning is not None or tokens is not None:
            outcome.reasoning, outcome.reasoning_tokens = reasoning, tokens
        if reasoning is not None or tokens is not None or self.stream.reader is not None:
            outcome.raw_text = self.stream.thinking.said(raw)  # as generated: the chat keeps it whole
        if calls and outcome.finish_reason == "stop":
            outcome.finish_reason = "tool_calls"
        outcome.image_tokens = self.image_tokens
        return outcome


class BeamReply:
    """Beam search prints nothing until the best beam is known: one piece, at the end."""

    def __init__(self, loaded: LoadedModel, ids: list[int], params: SamplingParams, beams: int) -> None:
        self._args = (loaded, ids, params, beams)
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        from llmcli.engine.beams import beam_search

        with terminal.status(f"Searching with {self._args[3]} beams…"):
            self._result = beam_search(*self._args)
        if self._result.text:
            yield CONTENT, self._result.text

    def interrupt(self) -> None:
        pass  # the search ran in transformers' own generate: there is no cache of ours to fix

    def outcome(self) -> Outcome:
        from llmcli.engine.loop import GenerationResult

        result = self._result or GenerationResult("", [], "interrupted")
        return outcome_of(result, self._args[2])


class LocalHistory:
    """A chat in-process: its messages, the exact ids the model saw, and the engine's cache."""

    def __init__(self, target: InProcessTarget, system: str | None) -> None:
        from llmcli.engine.conversation import Conversation

        self.target = target
        self.engine = target.engine
        self.conversation = Conversation(target.loaded.tokenizer, target.context_length, system=system)
        self.think_budget: int | None = None
        self._pending: tuple[str | list[dict[str, Any]], list[int], int] | None = None

    @property
    def system(self) -> str | None:
        return self.conversation.system

    @property
    def think_off(self) -> bool:
        return self.conversation.think_off

    @think_off.setter
    def think_off(self, off: bool) -> None:
        self.conversation.think_off = off  # the next prompt's generation prompt says so

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.conversation.messages

    @property
    def tools(self) -> ToolRequest | None:
        return self.conversation.tools

    @tools.setter
    def tools(self, request: ToolRequest | None) -> None:
        self.conversation.tools = request  # the template offers them in every prompt from now

    @property
    def context_used(self) -> int:
        return len(self.conversation.ids)

    @property
    def pending_tokens(self) -> int:
        """The prepared prompt's length."""
        return len(self._pending[1]) if self._pending else 0

    def reply_room(self, params: SamplingParams) -> int:
        """Tokens kept free for the reply when deciding whether the prompt fits."""
        return max(1, min(params.max_new_tokens, self.target.context_length // 4))

    def prepare(
        self,
        user_text: str | list[dict[str, Any]],
        sampling: SamplingSettings,
        steps: list[dict[str, Any]] | None = None,
    ) -> int:
        params = self.target.params(sampling)
        table = self.target.images([{"role": "user", "content": user_text}])
        if table is not None:  # from the first image on: the chat's images are kept by content
            self.conversation.images = table
        prompt, dropped = self.conversation.prompt_for(user_text, self.reply_room(params), steps)
        self._pending = (user_text, prompt, dropped)
        return dropped

    def ask(
        self,
        sampling: SamplingSettings,
        speculative: str,
        output: OutputFormat | None,
        tools: ToolRequest | None = None,
    ) -> LocalReply:
        assert self._pending is not None
        params = self.target.params(sampling)
        # The template's own stop strings end a text reply; a JSON reply ends with its value.
        template_stops = self.conversation.stop_strings if output is None else ()
        params = params.with_(stop=params.stop + template_stops)
        turn = self.target.tool_turn([], tools) if tools is not None else None
        if turn is not None and turn.output is not None:
            output = turn.output
        return self.target.generate(self._pending[1], params, speculative, output, self.think_budget, turn)

    def step(self, outcome: Outcome) -> None:
        """A reply that called tools, before their results: the ids the model saw and wrote,
        so that the next prompt of this turn reuses them (and the cache that holds them)."""
        assert self._pending is not None
        self.conversation.ids = self._pending[1] + outcome.token_ids

    def commit(self, outcome: Outcome, steps: list[dict[str, Any]] | None = None) -> None:
        assert self._pending is not None
        user_text, prompt, dropped = self._pending
        self._pending = None
        # The reply as generated, think block included: the template decides what it keeps.
        said = outcome.raw_text if outcome.raw_text is not None else outcome.text
        self.conversation.commit(
            user_text, prompt, dropped, said, outcome.token_ids, outcome.finish_reason, steps
        )

    def abandon(self, error: Exception) -> str | None:
        self._pending = None
        self.engine.restore_consistency()
        if type(error).__name__ == "OutOfMemoryError":
            self.engine.free_memory()
            return (
                f"out of memory during the reply ({len(self.engine.cached_ids)} tokens cached); "
                "the conversation is as it was — try /set max_new_tokens lower, /undo or /reset"
            )
        return None

    def set_system(self, text: str | None) -> None:
        self.conversation.set_system(text)

    def undo(self, keep_cache: bool = False) -> tuple[str | list[dict[str, Any]], str] | None:
        """Drop the last exchange; (user, reply) or None. The cache is cropped back, unless the
        same message is about to be asked again (/retry: its prompt is still cached)."""
        last = self.conversation.undo()
        if last is None:
            return None
        if not keep_cache:
            self._crop_cache_to_conversation()
        return last.user, last.reply

    def restore(self, user: str | list[dict[str, Any]], reply: str) -> None:
        """Put back an exchange that /retry took out, when the new attempt failed."""
        self.conversation.messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": reply},
        ]
        self.conversation.ids = self.conversation.history_ids()

    def reset(self) -> None:
        self.conversation.reset()
        self.engine.reset()

    def replace(
        self, system: str | None, messages: list[dict[str, Any]], room: SamplingSettings, where: str
    ) -> str:
        """A loaded transcript, prefilled now so that its next turn is fast."""
        conversation = self.conversation
        previous = (conversation.system, list(conversation.messages), list(conversation.ids))
        conversation.system, conversation.messages = system, [dict(m) for m in messages]
        conversation.ids = []
        conversation.ids = conversation.history_ids()
        needed = len(conversation.ids)
        if needed + self.reply_room(self.target.params(room)) > self.target.context_length:
            conversation.system, conversation.messages, conversation.ids = previous
            raise LlmcliError(
                f"{where} holds {needed} tokens; the context holds {self.target.context_length}"
            )
        prefilled = self.engine.warm(conversation.ids)
        return f" ({needed} tokens in context, {prefilled} prefilled now)"

    def describe(self) -> str:
        from llmcli.frontends.wording import plural

        return (
            f"context {len(self.conversation.ids)}/{self.target.context_length} tokens · "
            f"{plural(len(self.conversation.exchange_starts()), 'exchange')} · "
            f"cache holds {len(self.engine.cached_ids)}"
        )

    def _crop_cache_to_conversation(self) -> None:
        self.engine.keep_prefix_of(self.conversation.ids)

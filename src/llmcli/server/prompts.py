"""A request's prompts as token ids, and its sampling values checked: every request the
template, the tools or the context refuse is a 400 that says why, before any generation starts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from llmcli.config.settings import SamplingSettings
from llmcli.engine.reasoning import thinking_of
from llmcli.errors import LlmcliError
from llmcli.server.images import refs_in, resolve
from llmcli.server.protocol import ChatRequest, CompletionRequest, _Sampling
from llmcli.server.state import RequestError, Served, Ticket
from llmcli.server.worker import Job

if TYPE_CHECKING:
    from llmcli.engine.tools.turn import ToolTurn

T = TypeVar("T")


async def chat_prompt(
    served: Served, body: ChatRequest, continue_final: bool = False
) -> tuple[list[int], ToolTurn]:
    """The prompt's token ids as the template renders the request (its tools too); every
    request the template or the tools refuse is a 400 that says why. `continue_final`: the
    last message is the assistant's, for the reply to continue (Anthropic's prefill)."""
    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.image_rows import table_of
    from llmcli.engine.tools.turn import tool_turn

    try:
        tools = body.tool_request()
    except LlmcliError as error:
        param = error.message.split(":")[0] if not body.functions else "functions"
        raise RequestError(400, error.message, param) from None
    if tools is not None and tools.callable and body.response_format is not None:
        message = "tool calls and response_format at once are not supported: send one of them"
        raise RequestError(400, message, "response_format")

    options = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template = str(getattr(served.loaded.tokenizer, "chat_template", "") or "")
        if "reasoning_effort" in template:
            options["reasoning_effort"] = body.reasoning_effort
        elif not body.effort_is_a_hint:  # accepted and ignored would be a silent failure
            message = "this model's chat template does not read reasoning_effort"
            raise RequestError(400, message, "reasoning_effort")

    messages = await with_images(served, body)

    def tokenize() -> tuple[list[int], ToolTurn]:
        loaded = served.loaded
        tokenizer = loaded.tokenizer
        try:
            turn = tool_turn(tokenizer, messages, tools, loaded.vocab_size, loaded.eos_token_ids)
            ids = prompt_ids(
                tokenizer,
                turn.messages,
                think_off=body.think_off,
                options=options | turn.options,
                context_length=loaded.context_length,
                continue_final=continue_final,
                images=table_of(loaded) if served.reads_images else None,
            )
        except LlmcliError as error:  # a template that refuses them, a tool result that answers no call
            raise RequestError(400, error.message, "messages") from None
        return ids, turn

    return await on_worker(served, tokenize)


async def with_images(served: Served, body: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages in the neutral form, each image read (a bad one refused by its
    label), then refused or fetched as the server allows (images.resolve), off the event loop."""
    try:
        messages = body.chat_messages()
    except LlmcliError as error:
        raise RequestError(400, error.message, "messages") from None
    if next(refs_in(messages), None) is None:
        return messages
    try:
        return await asyncio.to_thread(resolve, messages, served.reads_images, served.allow_image_urls)
    except LlmcliError as error:
        raise RequestError(400, error.message, "messages") from None


async def completion_prompts(served: Served, body: CompletionRequest) -> list[list[int]]:
    """The completion's prompts as token ids (text, or ids checked against the vocabulary)."""
    loaded = served.loaded

    def tokenize() -> list[list[int]]:
        try:
            prompts = body.prompt_ids(loaded.tokenizer, loaded.context_length)
            body.check_ids(prompts, loaded.vocab_size)
        except LlmcliError as error:
            raise RequestError(400, error.message, "prompt") from None
        return prompts

    return await on_worker(served, tokenize)


async def on_worker(served: Served, work: Callable[[], T]) -> T:
    """Tokenize on the worker thread: a Rust tokenizer used from two threads at once can fail
    ("Already borrowed"), and the worker is using it to detokenize."""
    return await asyncio.get_running_loop().run_in_executor(served.worker, work)


def jobs_for(
    served: Served,
    body: _Sampling,
    prompts: list[list[int]],
    ticket: Ticket,
    *,
    chat: bool,
    tools: ToolTurn | None = None,
    to_context_end: bool = False,
) -> list[Job]:
    """One job per prompt and per `n`, every value checked. A request that sets no limit gets
    the model's generation_config.json's, else the built-in 512 tokens, as the CLI does: each
    generation reserves the KV memory its limit may fill, so "up to the context" is asked for,
    never a default (`to_context_end`: Ollama's num_predict -1)."""
    sampling = checked_sampling(body)
    if sampling.max_new_tokens is None and to_context_end:
        room = served.loaded.context_length - max(len(ids) for ids in prompts)
        sampling = replace(sampling, max_new_tokens=max(room, 1))  # a prompt with no room: refused below
    method = body.speculative or served.speculative
    if method not in served.speculations:
        start = "--speculative mtp" if method == "mtp" else "--draft-model"
        drafter = "MTP head to draft with" if method == "mtp" else "draft model"
        raise RequestError(400, f"this server has no {drafter}: start it with {start}", "speculative")
    output = tools.output if tools is not None else None
    if body.response_format is not None:
        try:
            output = body.response_format.output()
        except LlmcliError as error:
            raise RequestError(400, error.message, "response_format") from None
    for ids in prompts:
        check_fits(served, ids, sampling, chat)
    try:
        bias = body.bias(served.loaded.vocab_size)
    except LlmcliError as error:
        raise RequestError(400, error.message, "logit_bias") from None
    logprobs, echo = logprobs_asked(body, method)
    budget = getattr(body, "think_budget", None)
    if budget is not None and thinking_of(served.loaded.tokenizer) is None:
        message = "a thinking budget needs a model that thinks, and this model's template marks none"
        raise RequestError(400, message, "think_budget")
    key = body.prompt_cache_key  # a hint for the slot each runs on
    jobs = [
        Job(ids, sample(sampling, k), method, output, chat, ticket, tools, bias, logprobs, echo, budget, key)
        for ids in prompts
        for k in range(body.n)
    ]
    if served.slots is not None and served.slots.count > 1:
        first_of: dict[tuple[int, ...], Job] = {}
        for index, job in enumerate(jobs):  # started in this order: the one waited for has a thread
            first = first_of.setdefault(tuple(job.ids), job)
            if first is not job:
                jobs[index] = replace(job, after=first.prompt_cached)
    return jobs


def sample(sampling: SamplingSettings, k: int) -> SamplingSettings:
    """The k-th of n choices: a given seed moves on by k, so that the choices differ."""
    return sampling if k == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + k)


def check_fits(served: Served, ids: list[int], sampling: SamplingSettings, chat: bool) -> None:
    context = served.loaded.context_length
    if len(ids) >= context:
        message = f"the prompt is {len(ids)} tokens; the context holds {context}"
        raise RequestError(400, message, "messages" if chat else "prompt", "context_length_exceeded")
    if sampling.max_new_tokens is not None and len(ids) + sampling.max_new_tokens > context:
        message = (
            f"max_tokens {sampling.max_new_tokens} with a {len(ids)}-token prompt "
            f"exceeds the context of {context}"
        )
        raise RequestError(400, message, "max_tokens", "context_length_exceeded")


def logprobs_asked(body: _Sampling, method: str) -> tuple[int | None, bool]:
    """(alternatives per token or None, echo): chat's logprobs/top_logprobs, completions'
    logprobs N and echo. Drafts are checked several at a time: not with logprobs."""
    if isinstance(body, ChatRequest):
        try:
            count, echo = body.logprob_count(), False
        except LlmcliError as error:
            raise RequestError(400, error.message, "top_logprobs") from None
    else:
        count, echo = getattr(body, "logprobs", None), bool(getattr(body, "echo", False))
    if count is not None and body.speculative not in (None, "off"):
        raise RequestError(400, "logprobs and speculative decoding do not combine", "speculative")
    return count, echo


def checked_sampling(body: _Sampling) -> SamplingSettings:
    sampling = body.sampling()
    try:
        sampling.validate("request")
    except LlmcliError as error:
        raise RequestError(400, error.message) from None
    return sampling

"""Beam search, as transformers defines it: `generate(num_beams=N, do_sample=False)` on the
model llmcli loaded, with the model's own length penalty and early stopping, under llmcli's
stop strings and end-of-sequence tokens.

Beams keep N sequences and pick the best by a length-normalized score once they end, so
nothing can be printed before the search is over: the text comes at the end. The search is
transformers' own (the reference it must equal), run on whichever weights llmcli loaded —
native int8/int4 layers included, since they stand in the model's own modules.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher
from llmcli.engine.loop import GenerationResult
from llmcli.engine.stats import GenerationStats
from llmcli.errors import ContextOverflowError, UsageError

if TYPE_CHECKING:
    from llmcli.models.load import LoadedModel


def beam_search(
    loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams, beams: int
) -> GenerationResult:
    """The best of `beams` beams for this prompt; the text is cut at the first stop string."""
    from transformers import GenerationConfig

    if len(prompt_ids) >= loaded.context_length:
        raise ContextOverflowError(
            f"the prompt is {len(prompt_ids)} tokens; the model's context holds {loaded.context_length}",
            "shorten the input",
        )
    if params.presence_penalty or params.frequency_penalty or params.logit_bias:
        # transformers' beam search has no such rules: honoured nowhere, so refused here.
        raise UsageError("beam search takes no presence or frequency penalty and no logit bias")
    model, tokenizer = loaded.model, loaded.tokenizer
    defaults = model.generation_config
    eos = sorted(loaded.eos_token_ids)
    budget = min(params.max_new_tokens, loaded.context_length - len(prompt_ids))
    config = GenerationConfig(
        num_beams=beams,
        do_sample=False,
        max_new_tokens=budget,
        length_penalty=defaults.length_penalty,
        early_stopping=defaults.early_stopping,
        repetition_penalty=params.repetition_penalty,
        eos_token_id=eos or None,
        pad_token_id=defaults.pad_token_id if defaults.pad_token_id is not None else (eos or [0])[0],
        stop_strings=list(params.stop) or None,
    )
    input_ids = torch.tensor([prompt_ids], device=loaded.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            tokenizer=tokenizer if params.stop else None,
        )
    seconds = time.perf_counter() - start
    tokens = output[0, len(prompt_ids) :].tolist()
    ended = next((i for i, token in enumerate(tokens) if token in loaded.eos_token_ids), None)
    if ended is not None:
        tokens = tokens[: ended + 1]  # beams that ended earlier are padded after their end
    text, stopped = _text_of(tokenizer, tokens, params.stop, cut=ended is None)
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids),
        prefilled_tokens=len(prompt_ids),
        completion_tokens=len(tokens),
        ttft_s=seconds,  # nothing is shown before the search ends
        decode_s=seconds,
    )
    finish = "stop" if ended is not None or stopped else "length"
    return GenerationResult(text=text, token_ids=tokens, finish_reason=finish, stats=stats)


def _text_of(tokenizer: object, tokens: list[int], stop: tuple[str, ...], cut: bool) -> tuple[str, bool]:
    """The text of `tokens` as the streaming loop would print it: up to the first stop string
    (`cut`: by the length limit, which drops a character it cut in its middle)."""
    detok, matcher = IncrementalDetokenizer(tokenizer), StopMatcher(stop)
    text = ""
    for token in tokens:
        text += matcher.feed(detok.push(token))
        if matcher.stopped:
            return text, True
    text += matcher.feed(detok.flush(cut=cut))
    return (text, True) if matcher.stopped else (text + matcher.flush(), False)

"""Log-probabilities in OpenAI's two shapes: chat's (`logprobs.content`, an entry per token with
its `top_logprobs`) and text completions' (parallel `tokens` / `token_logprobs` / `top_logprobs`
/ `text_offset` lists). Defined as vLLM defines them: the log-softmax of the model's own logits,
before any sampling rule or grammar. With `echo`, the prompt's tokens come first, scored in one
pass (the first has no logprob: nothing comes before it).
"""

from __future__ import annotations

from typing import Any

from llmcli.engine.producers import TokenLogprob


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(entry.token_id, entry.logprob), "top_logprobs": [one(i, lp) for i, lp in entry.top]}
            for entry in entries
        ]
    }


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], entries: list[TokenLogprob | None], offset: int = 0
) -> dict[str, Any]:
    """`entries[i]` scores `token_ids[i]` (None: the prompt's first token); offsets count from
    `offset` characters into the text."""
    tokens, offsets = [], []
    for token_id in token_ids:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob if entry else None for entry in entries],
        "top_logprobs": [_by_text(tokenizer, entry.top) if entry else None for entry in entries],
        "text_offset": offsets,
    }


def _by_text(tokenizer: Any, top: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI's completions shape keys alternatives by their text: two byte pieces of one
    character both read "\ufffd", and the likelier one is kept."""
    alternatives: dict[str, float] = {}
    for token_id, logprob in top:
        alternatives.setdefault(token_text(tokenizer, token_id), logprob)
    return alternatives


def score_prompt(engine: Any, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the ones before it, in one pass over the
    prompt (which the cache then holds, for the completion to reuse)."""
    engine.start_over()
    rows = engine.score(ids).float().log_softmax(dim=-1)
    scored: list[TokenLogprob | None] = [None]
    for position in range(len(ids) - 1):
        row, token_id = rows[position], ids[position + 1]
        best = row.topk(top) if top else None
        alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best else []
        scored.append(TokenLogprob(token_id, float(row[token_id]), alternatives))
    return scored

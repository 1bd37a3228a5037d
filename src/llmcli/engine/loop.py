"""The hot loop: prefill the prompt in one forward pass, then one token per forward step.

The engine owns the KV cache and the exact token ids it holds (`cached_ids`), so a later call
whose prompt starts with those ids prefills only the rest. It never prints: a `Generation` yields
text pieces and ends with a `GenerationResult`.

Two caches: a DynamicCache that grows with the text, or (`fast`) a static cache preallocated for
the whole context, whose fixed shapes let the one-token decode step be captured as a CUDA graph.
Cropping a static cache is moving its write position back: what lies past it is never attended
to (the causal mask stops at the current position) and is overwritten by the next tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher
from llmcli.engine.sampling import make_generator, pick_token, process_logits
from llmcli.engine.stats import GenerationStats
from llmcli.errors import ContextOverflowError

if TYPE_CHECKING:
    from llmcli.models.load import LoadedModel


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # every sampled token, the end-of-sequence token included
    finish_reason: str  # "stop", "length" or "interrupted"
    stats: GenerationStats = field(default_factory=GenerationStats)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    def __init__(
        self,
        model: Any,
        eos_token_ids: frozenset[int],
        context_length: int,
        *,
        static_cache: bool = False,
        compile_decode: bool = False,
    ) -> None:
        self.model = model
        self.device = model.device
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.static_cache = static_cache or compile_decode  # graphs need fixed shapes
        self.cache: Any = None
        self.cached_ids: list[int] = []  # exactly the tokens whose keys/values sit in `cache`
        self._decode = self._decode_eager
        if compile_decode:
            from llmcli.engine.graphs import compile_decode_step

            self._decode = compile_decode_step(self._decode_eager)

    @classmethod
    def for_loaded(cls, loaded: LoadedModel) -> Engine:
        """The engine a loaded model asked for: graph-captured decode on a static cache where that
        pays (CUDA, unless --no-fast), the dynamic cache elsewhere (--fast on CPU: static only)."""
        return cls(
            loaded.model,
            loaded.eos_token_ids,
            loaded.context_length,
            static_cache=loaded.fast_decode,
            compile_decode=loaded.fast_decode and loaded.device.type == "cuda",
        )

    def reset(self) -> None:
        """Forget everything cached. A static cache keeps its memory: a CUDA graph replays on
        those very addresses, and a new allocation would mean capturing it again."""
        if self.static_cache:
            self.crop_to(0)
        else:
            self.cache = None
        self.cached_ids = []

    def warm_up(self) -> float:
        """Pay the compile and capture cost now rather than in the first reply; seconds taken."""
        start = time.perf_counter()
        first = self.prefill([0])
        token = first.argmax(dim=-1)
        for _ in range(3):  # the first runs compile, the next ones record and replay the graph
            self.decode_step(token)
            self.cached_ids.append(int(token))
        self.reset()
        return time.perf_counter() - start

    @torch.inference_mode()  # the cache's tensors were made in inference mode
    def crop_to(self, keep: int) -> None:
        """Forget cached tokens past the first `keep`.

        Layer by layer, because a forward pass interrupted by Ctrl-C may have appended to some
        layers and not to others: after this, every layer holds exactly `keep` positions.
        """
        del self.cached_ids[keep:]
        if self.cache is None:
            return
        for layer in self.cache.layers:
            if self.static_cache:
                # transformers ≥ 5.2 keeps each static layer's write position in a tensor; older
                # versions write where cache_position says, which we always pass.
                position = getattr(layer, "cumulative_length", None)
                if isinstance(position, torch.Tensor):
                    position.fill_(keep)
                continue
            extra = layer.get_seq_length() - keep
            if extra > 0:
                # A negative count removes that many tokens, in transformers 4.5x and 5.x alike.
                layer.crop(-extra)

    def restore_consistency(self) -> None:
        """After an interrupted call: make the cache hold exactly `cached_ids` again."""
        self.crop_to(len(self.cached_ids))

    def free_memory(self) -> None:
        """Hand the allocator's cached blocks back after an out-of-memory error."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reuse_prefix(self, ids: list[int]) -> int:
        """Crop the cache to its longest common prefix with `ids`; return how many tokens it keeps.

        At least one token of `ids` is left to run, since the next token's logits come from it.
        """
        return self._keep_common_prefix(ids, at_most=len(ids) - 1)

    def _keep_common_prefix(self, ids: list[int], at_most: int) -> int:
        keep = min(common_prefix_length(self.cached_ids, ids), at_most)
        self.crop_to(keep)
        return keep

    def warm(self, ids: list[int]) -> int:
        """Bring the cache to hold `ids` (a loaded chat), prefilling only what is not cached yet.
        Returns the number of tokens prefilled."""
        keep = self._keep_common_prefix(ids, at_most=len(ids))
        if keep < len(ids):
            self.prefill(ids[keep:])
        return len(ids) - keep

    def _new_cache(self) -> Any:
        from transformers import DynamicCache, StaticCache

        if self.static_cache:
            return StaticCache(config=self.model.config, max_cache_len=self.context_length)
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after what is cached, in one pass; the logits for the next token, [1, vocab]."""
        if self.cache is None:
            self.cache = self._new_cache()
        start = len(self.cached_ids)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            cache_position=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cached_ids.extend(ids)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one sampled token (shape [1]); the logits for the one after it, [1, vocab]."""
        position = torch.tensor([len(self.cached_ids)], device=self.device)
        return self._decode(token.view(1, 1), position)

    def _decode_eager(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, past_key_values=self.cache, cache_position=position, use_cache=True
        )
        return out.logits[:, -1, :]

    def generate(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Any) -> Generation:
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflowError(
                f"the prompt is {len(prompt_ids)} tokens; the model's context holds {self.context_length}",
                "shorten the input",
            )
        return Generation(self, prompt_ids, params, tokenizer)


class Generation:
    """One call in progress. Iterate it for text pieces; `result` is valid at any point after."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, tokenizer: Any) -> None:
        self._engine = engine
        self._prompt_ids = list(prompt_ids)
        self._params = params
        # No tokenizer (a benchmark on random weights): tokens only, no text.
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopMatcher(params.stop)
        self._emitted: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason = "interrupted"  # until the loop says otherwise
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.prefill_logits: torch.Tensor | None = None  # the first step's logits, for exactness checks
        # Room left in the context bounds the reply as much as --max-new-tokens does.
        self._budget = min(params.max_new_tokens, engine.context_length - len(prompt_ids))

    def __iter__(self) -> Iterator[str]:
        for piece in self._run():
            self._emitted.append(piece)
            yield piece

    def interrupt(self) -> None:
        """Ctrl-C arrived: whatever the loop was doing, the cache must match `cached_ids` again."""
        self.finish_reason = "interrupted"
        self._engine.restore_consistency()

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(
            text="".join(self._emitted),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
        )

    def _run(self) -> Iterator[str]:
        engine, params, stats = self._engine, self._params, self.stats
        start = time.perf_counter()
        reused = engine.reuse_prefix(self._prompt_ids)
        stats.prefilled_tokens = len(self._prompt_ids) - reused
        logits = engine.prefill(self._prompt_ids[reused:])
        self.prefill_logits = logits
        generator = make_generator(params.seed, engine.device) if not params.greedy else None
        seen = torch.tensor([self._prompt_ids], dtype=torch.long, device=engine.device)
        first_token_at = start
        for step in range(self._budget):
            token = pick_token(process_logits(logits, seen, params), params, generator)
            token_id = int(token)  # the one host sync per token: we need the id to print it
            now = time.perf_counter()
            if step == 0:
                first_token_at = now
                stats.ttft_s = now - start
            stats.decode_s = now - first_token_at
            stats.token_times.append(now)
            self.token_ids.append(token_id)
            stats.completion_tokens = len(self.token_ids)
            if token_id in engine.eos_token_ids:
                self.finish_reason = "stop"
                break
            piece = self._stop.feed(self._detok.push(token_id) if self._detok else "")
            if piece:
                yield piece
            if self._stop.stopped:
                self.finish_reason = "stop"
                return
            if step + 1 == self._budget:
                self.finish_reason = "length"
                break
            if params.repetition_penalty != 1.0:
                seen = torch.cat([seen, token.view(1, 1)], dim=1)
            logits = engine.decode_step(token)
            engine.cached_ids.append(token_id)
        # The end: a character the model left unfinished, and text held back as a possible stop string.
        tail = self._stop.feed(self._detok.flush() if self._detok else "")
        if self._stop.stopped:
            self.finish_reason = "stop"
        else:
            tail += self._stop.flush()
        if tail:
            yield tail

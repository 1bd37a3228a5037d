"""The transformers backend: any architecture transformers runs, through its own model code.

The fallback for architectures the native engine does not implement, and the reference it is
tested against. Two caches: a DynamicCache that grows with the text, or (`static_cache`) a
StaticCache preallocated for the whole context, whose fixed shapes let `torch.compile`'s
reduce-overhead mode capture the decode step as a CUDA graph (`compile_decode`, opt-in).
Cropping a static cache moves each layer's write position back: what lies past it is never
attended to (the causal mask stops at the current position) and is overwritten.

Not every layer's state can go back: a recurrent state (Mamba, gated DeltaNet) or a short
convolution's (LFM2) folds in every token it has seen, and a sliding window that has let a
position go no longer has it (transformers refuses that crop). Where a crop needs one of those,
the whole cache is emptied (`length` says what was kept: nothing), and the loop prefills the prompt
again: the fallback costs a prefill, never a wrong or failed reply.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import torch


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache as the model's forward takes it: `cache` from transformers 5.24 on (which
    warns, on stderr, about the old name), `past_key_values` before."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class TransformersBackend:
    name = "transformers"

    def __init__(
        self, model: Any, context_length: int, *, static_cache: bool = False, compile_decode: bool = False
    ) -> None:
        self.model = model
        self.device = model.device
        self.context_length = context_length
        self.static_cache = static_cache or compile_decode  # graphs need fixed shapes
        self.cache: Any = None
        self._length = 0
        # True while a forward pass runs: one cut short (Ctrl-C) has moved a recurrent state
        # by an unknown number of tokens.
        self._in_pass = False
        self.compiled = compile_decode
        self._decode = _compiled(self._decode_eager) if compile_decode else self._decode_eager

    @property
    def length(self) -> int:
        return self._length

    def _new_cache(self) -> Any:
        from transformers import DynamicCache, StaticCache

        if self.static_cache:
            return StaticCache(config=self.model.config, max_cache_len=self.context_length)
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self._forward(ids, logits_to_keep=1)[:, -1, :]

    @torch.inference_mode()
    def score(self, ids: list[int]) -> torch.Tensor:
        return self._forward(ids, logits_to_keep=0)[0]  # 0: every position's logits

    def _forward(self, ids: list[int], logits_to_keep: int) -> torch.Tensor:
        if self.cache is None:
            self.cache = self._new_cache()
        start = self._length
        self._in_pass = True
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
            **with_cache(self.model, self.cache),
            cache_position=torch.arange(start, start + len(ids), device=self.device),
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self._in_pass = False
        self._length = start + len(ids)
        return out.logits

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        position = torch.tensor([self._length], device=self.device)
        self._in_pass = True
        logits = self._decode(token.view(1, 1), position)
        self._in_pass = False
        self._length += 1
        return logits

    def _decode_eager(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, **with_cache(self.model, self.cache), cache_position=position, use_cache=True
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()  # the cache's tensors were made in inference mode
    def crop(self, length: int) -> None:
        """Layer by layer, because a forward pass interrupted by Ctrl-C may have appended to some
        layers and not to others: after this, every layer holds exactly `length` positions, or
        none at all where a layer cannot give back what it would have to."""
        held, self._length = self._length, min(self._length, length)
        if self.cache is None:
            return
        if not all(self._can_keep(layer, held, self._length) for layer in self.cache.layers):
            self._empty()
            return
        for layer in self.cache.layers:
            if not hasattr(layer, "get_seq_length") or _has_state(layer):
                continue  # KV shared from another layer; a state that stays as it is
            if self.static_cache:
                # transformers ≥ 5.2 keeps each static layer's write position in a tensor; older
                # versions write where cache_position says, which we always pass.
                position = getattr(layer, "cumulative_length", None)
                if isinstance(position, torch.Tensor):
                    position.fill_(self._length)
                if hasattr(layer, "cumulative_length_int"):  # a static sliding layer's own count
                    layer.cumulative_length_int = self._length
                continue
            extra = int(layer.get_seq_length()) - self._length
            if extra > 0:
                # A negative count removes that many tokens, in transformers 4.5x and 5.x alike.
                layer.crop(-extra)

    def resumable(self, length: int) -> int:
        """`length` (at most what is held) where every layer can go back to it, else 0: a
        recurrent layer cannot go back, nor a sliding window that has let a position go."""
        length = min(length, self._length)
        layers = self.cache.layers if self.cache is not None else []
        return length if all(self._can_keep(layer, self._length, length) for layer in layers) else 0

    def _can_keep(self, layer: Any, held: int, length: int) -> bool:
        """Whether `layer` can be brought back to its first `length` positions (the cache
        holds `held`, as far as complete passes go)."""
        if _has_state(layer):
            # Every token seen is folded into it: it can stay as it is, never go back.
            return not self._in_pass and length >= held
        if not hasattr(layer, "get_seq_length"):
            return True  # holds nothing of its own: its keys and values are another layer's
        positions = int(layer.get_seq_length())
        if positions <= length or not getattr(layer, "is_sliding", False):
            return True
        return positions < layer.get_max_length()  # a window that has let no position go yet

    def _empty(self) -> None:
        """Nothing cached: a static cache keeps its memory (a CUDA graph replays on its addresses)."""
        if self.static_cache:
            self.cache.reset()
        else:
            self.cache = None
        self._length = 0
        self._in_pass = False

    def save(self) -> None:
        """Not offered: transformers' caches keep state of their own per layer type (sliding
        windows, static write positions) that a copy of the tensors would not carry."""
        return None

    def restore(self, saved: Any) -> None:
        raise NotImplementedError("save() gives nothing to restore")

    def reset(self) -> None:
        """A static cache keeps its memory: a CUDA graph replays on those very addresses."""
        if self.static_cache:
            self.crop(0)  # positions moved back where it can, else its state zeroed
        else:
            self._empty()

    @property
    def captures_graphs(self) -> bool:
        return self.compiled

    def warm_up(self) -> float:
        """Pay the compile and capture cost now rather than in the first reply."""
        start = time.perf_counter()
        token = self.prefill([0]).argmax(dim=-1)
        for _ in range(3):  # the first runs compile, the next ones record and replay the graph
            token = self.decode(token).argmax(dim=-1)
        self.reset()
        return time.perf_counter() - start


def _has_state(layer: Any) -> bool:
    """A layer with a recurrent state (Mamba, gated DeltaNet) or a convolution's (LFM2): a
    summary of every token so far rather than one entry per position."""
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def _compiled(step: Callable[..., Any]) -> Callable[..., Any]:
    """The step under torch.compile's reduce-overhead mode (CUDA graphs): paid once per process,
    with inductor's artefacts kept in llmcli's cache so the next process compiles faster."""
    from llmcli.config.paths import cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    # The step's inputs change every token; the cache tensors are marked static by transformers.
    return torch.compile(step, mode="reduce-overhead", fullgraph=False, dynamic=False)

"""llmcli's own forward pass: the model as a plain function of token ids, an attention plan and
a KV cache, with the layer loop written once.

    embedding → every block (its attention through the plan) → norm → logits

The family (families/) gives the weights and the blocks, settled when the model is built; the
plan (plans.py) says how this pass meets the cache: a prefill chunk, an exact decode step, a
graphed bucket step, a speculative check row by row or in one call. The per-token path has no
configuration branches and no Python work that does not launch a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.image_rows import ImageTable, PassImages
from llmcli.engine.native.families import family_of
from llmcli.engine.native.kvcache import KVCache, ring_size
from llmcli.engine.native.plans import (
    BucketStep,
    CausalChunk,
    ExactDecode,
    PaddedRows,
    PerRowCheck,
    Plan,
    RowsInOneCall,
    SequencesStep,
)
from llmcli.engine.native.pool import SlotPool
from llmcli.engine.native.recurrent_cache import RecurrentCache


def _rope_sign(half: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """−1 on the first half of a rotated width of 2 × `half`, +1 on the second (Transformer.rope)."""
    return torch.tensor([-1.0] * half + [1.0] * half, dtype=dtype, device=device)


class Transformer:
    def __init__(self, model: Any, context_length: int) -> None:
        weights = family_of(model).weights(model, context_length)
        self.shape = weights.shape
        self.embedding = weights.embedding
        self.blocks = weights.blocks
        self.norm = weights.norm
        self.output = weights.output
        self.inv_freq = weights.inv_freq
        self.rope_scale = weights.rope_scale
        self.local_rope = weights.local_rope
        self.logit_softcap = weights.logit_softcap
        self.before_blocks = weights.before_blocks
        self.rope_axes = weights.rope_axes
        # The images of this model's prompts (engine/image_rows.py), where it reads images: set
        # by the loader; the backends over these weights share it.
        self.images: ImageTable | None = None
        # In the embedding's dtype, as transformers scales it (Gemma).
        self.embed_scale = (
            torch.tensor(weights.embed_scale, dtype=weights.embedding.dtype, device=weights.embedding.device)
            if weights.embed_scale is not None
            else None
        )
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        # On a CPU the residual stream stays fp32 between layers (as llama.cpp keeps it): bf16
        # sums over 30 layers tipped the demo's near-tied first token, and it costs nothing there.
        self.residual_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        # Blocks with a state per sequence rather than keys and values (Qwen3.5's linear attention).
        self.recurrent = any(block.attention is None for block in self.blocks)
        # What each sequence holds beside its keys and values, whatever its length: those blocks'
        # states (counted where sequences at once are bounded by memory, scheduler.Slots).
        self.state_bytes = sum(
            block.mixer.shape.state_bytes(self.dtype) for block in self.blocks if block.attention is None
        )
        # A drafter that reads the model's own hidden states (the MTP head, mtp.py) sets this:
        # each pass hands it the plan and every row's final-norm output, the rows the logits
        # come from. None (the rule): only the rows the logits need are normed.
        self.hidden_tap: Callable[[Plan, torch.Tensor], None] | None = None
        # Each RoPE table's sign vector (their widths differ where a kind of layer has wider heads).
        tables = [self.inv_freq] + ([self.local_rope[0]] if self.local_rope else [])
        self.rope_signs = {
            freqs.shape[0]: _rope_sign(freqs.shape[0], self.dtype, self.device) for freqs in tables
        }

    def _slots(self) -> tuple[list[int | None], list[tuple[int, int]], list[bool]]:
        """The cache's layers (slots): each one's window, (KV heads, head width) and whether it
        keeps keys and values, from the attention that owns it. A block's attention names its
        slot (`layer`): its own, or the one it reads (Gemma 4's KV sharing: one slot written,
        several read; the readers' own slots keep nothing). A linear-attention block has no
        attention: its slot keeps nothing, its state is held apart (RecurrentCache)."""
        shape = self.shape
        windows: list[int | None] = [None] * shape.layers
        shapes = [(shape.kv_heads, shape.head_dim)] * shape.layers
        kept = [False] * shape.layers
        for block in self.blocks:
            if block.attention is not None:
                attention = block.attention
                windows[attention.layer] = attention.window
                shapes[attention.layer] = (attention.shape.kv_heads, attention.shape.head_dim)
                kept[attention.layer] = True
        return windows, shapes, kept

    def read_images_whole(self, layers: tuple[int, ...]) -> None:
        """Let an image's rows attend to each other both ways in a prefill in these layers
        (Gemma 3: all; Gemma 4: its sliding ones), as the model's vision part says."""
        for index in layers:
            attention = self.blocks[index].attention
            if attention is not None:
                attention.sees_images_whole = True

    def new_cache(self, context_length: int, pool: SlotPool | None = None) -> KVCache:
        shape = self.shape
        windows, shapes, kept = self._slots()
        args = (shape.layers, shape.kv_heads, shape.head_dim, context_length, self.dtype, self.device)
        if not self.recurrent:
            return KVCache(*args, windows, pool, kept, shapes)
        return RecurrentCache(*args, windows, pool, kept, shapes, state_bytes=self.state_bytes)

    def new_pool(self, context_length: int) -> SlotPool:
        """A pool for several sequences' caches (pool.py): one attention call per layer for them all."""
        shape = self.shape
        # A ring layer keeps its ring in each cache; a layer that keeps no keys and values (its
        # state is held per cache, or it reads another's) takes no room in the pool either.
        windows, shapes, kept = self._slots()
        pooled = [
            keeps and ring_size(window, context_length) is None
            for window, keeps in zip(windows, kept, strict=True)
        ]
        return SlotPool(
            shape.layers, shape.kv_heads, shape.head_dim, pooled, self.dtype, self.device, shapes=shapes
        )

    def rope(
        self, positions: torch.Tensor, table: tuple[torch.Tensor, float] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] for these positions (shaped once a pass to broadcast
        over heads, not once a layer), computed as transformers computes cos and sin (sin negated
        on its first half, for `rotate`); from `table` (frequencies and scale) where given, else
        the model's own. Positions [3, T] (image rows in Qwen's multimodal RoPE): each frequency
        turns by the one of its axis (`rope_axes`)."""
        inv_freq, scale = table if table is not None else (self.inv_freq, self.rope_scale)
        if positions.dim() == 2:
            assert self.rope_axes is not None, "positions over three axes for a model with one"
            freqs = positions.float()[self.rope_axes].T[:, None, :] * inv_freq
        else:
            freqs = positions.float()[:, None, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * scale).to(self.dtype)
        return cos, (angles.sin() * scale).to(self.dtype) * self.rope_signs[inv_freq.shape[0]]

    def forward(self, tokens: torch.Tensor, plan: Plan, images: PassImages | None = None) -> torch.Tensor:
        """`tokens` [T] through every block; logits [1 or T, vocab] as the plan asks. `images`:
        what the markers among them stand for (image_rows.py); their rows' embeddings replace
        the embedded tokens' there, after the family's scaling, as transformers merges them."""
        at = plan.positions if plan.rope_positions is None else plan.rope_positions
        ropes = {"global": self.rope(at)}
        if self.local_rope is not None:
            ropes["local"] = self.rope(at, self.local_rope)
        if images is not None:
            tokens = images.tokens
        h = self.embed(tokens)
        if images is not None and images.rows.numel():
            h = h.index_copy(0, images.rows, images.embeddings.to(h.dtype))
        if self.before_blocks is not None:
            self.before_blocks(tokens, h)
        h = h.to(self.residual_dtype)
        for block in self.blocks:
            h = block(h, *ropes[block.rope], plan)
        plan.finish()
        tap = self.hidden_tap
        normed = self.norm(h[-1:] if plan.last_only and tap is None else h)
        if tap is not None:
            tap(plan, normed)
            normed = normed[-1:] if plan.last_only else normed
        logits = self.output(normed)
        if self.logit_softcap is not None:  # in the model's dtype, as transformers caps them
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for `tokens` [T], scaled as the family says, in its dtype."""
        embedding = self.embedding
        h = F.embedding(tokens, embedding) if isinstance(embedding, torch.Tensor) else embedding.rows(tokens)
        return h * self.embed_scale if self.embed_scale is not None else h

    # The passes the backend runs, by name --------------------------------------------------

    def prefill(self, ids: torch.Tensor, cache: KVCache, images: PassImages | None = None) -> torch.Tensor:
        """Run `ids` [T] after what `cache` holds; logits [1, vocab] for the token after them."""
        return self.forward(ids, CausalChunk(cache, ids.shape[0], self.device, images), images)

    def decode(
        self, token: torch.Tensor, position: int | torch.Tensor, cache: KVCache, bucket: int | None = None
    ) -> torch.Tensor:
        """One token [1]; logits [1, vocab]. Without a `bucket`: attention over exactly the
        positions filled (`position` an int). With one: the graphable step over the bucket
        (`position` a [1] device tensor). The caller advances cache.length."""
        if bucket is None:
            return self.forward(token, ExactDecode(cache, int(position), self.device))
        return self.forward(token, BucketStep(cache, position, bucket))

    def decode_sequences(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One token [B] for each of B sequences, token b after what caches[b] holds; logits
        [B, vocab], row b what `decode` would give for it alone; each cache holds its token after."""
        for cache in caches:
            cache.ensure(cache.length + 1)
        steps = [ExactDecode(cache, cache.length, self.device) for cache in caches]
        return self.forward(tokens, SequencesStep(steps))

    def decode_padded(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: SlotPool, bucket: int
    ) -> torch.Tensor:
        """The fixed-shape step of several sequences in one pool (plans.PaddedRows): token b at
        positions[b] of slot slots[b]; logits [B, vocab]. The caller moves the lengths on."""
        return self.forward(tokens, PaddedRows(pool, positions, slots, bucket))

    def verify(self, ids: torch.Tensor, cache: KVCache, buckets: bool) -> torch.Tensor:
        """Run `ids` [T] after what `cache` holds; logits [T, vocab], row i exactly what the
        decode step would give after ids[: i + 1] (plans.PerRowCheck)."""
        return self.forward(ids, PerRowCheck(cache, ids.shape[0], buckets, self.device))

    def check_rows(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, span: int
    ) -> torch.Tensor:
        """The graphed check pass (plans.RowsInOneCall); logits [R, vocab]. The caller sets
        cache.length."""
        return self.forward(tokens, RowsInOneCall(cache, positions, span))

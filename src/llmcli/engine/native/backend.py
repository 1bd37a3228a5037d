"""The native backend: llmcli's forward pass over its own KV cache, graph-captured on CUDA."""

from __future__ import annotations

import time
from typing import Any

import torch

from llmcli.engine.image_markers import chunk_ends, inside_image
from llmcli.engine.native.forward import Transformer
from llmcli.engine.native.graphs import StepGraphs
from llmcli.engine.native.kvcache import SavedCache
from llmcli.engine.native.pool import SlotPool
from llmcli.engine.native.recurrent_cache import RecurrentCache
from llmcli.errors import LlmcliError, UsageError

# Long prompts are prefilled in chunks: attention after cached tokens needs a mask of chunk ×
# cached positions (and, on kernels without grouped-query support, scores as large), which a
# chunk bounds; each chunk is still large enough to keep the matrix units busy.
PREFILL_CHUNK = 1024
# With graphs, passes of up to this many tokens (speculative checks, a draft model catching up)
# replay a graph padded to the next of these sizes: run eagerly they would cost a few hundred
# launches, several decode steps' worth on a GPU (measured: 7.5× a 1B decode step for 2 tokens).
GRAPHED_ROWS = (2, 4, 8, 16)


class NativeBackend:
    """`graphs`: replay the decode step as a CUDA graph per length bucket. `static_shapes`:
    run that very bucketed, masked step eagerly (what a graph would replay; on a CPU this is how
    tests check it). Neither: the decode step attends over exactly the filled length."""

    name = "native"

    def __init__(
        self,
        model: Any,
        context_length: int,
        *,
        graphs: bool = False,
        static_shapes: bool = False,
        net: Transformer | None = None,
        pool: SlotPool | None = None,
    ) -> None:
        # `net`: another backend's, for one more cache over the same weights (several sequences);
        # `pool`: that cache in a slot of it, beside the others' (their decode steps batched).
        self.net = net or Transformer(model, context_length)
        self.device = self.net.device
        self.cache = self.net.new_cache(context_length, pool)
        if self.net.recurrent:  # a state per sequence has no bucketed step to replay yet
            if static_shapes:  # --fast asked for exactly that: refused, not dropped
                raise UsageError(
                    "--fast: the native engine has no fixed-shape (graphed) step for this model's "
                    "recurrent layers yet",
                    "leave --fast out",
                )
            graphs = False
        self.static_shapes = static_shapes or graphs
        # The graphed steps' inputs live at fixed addresses, for the graphs to read: one token and
        # position for the decode step, up to GRAPHED_ROWS[-1] of each for a short pass.
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._tokens = torch.zeros(GRAPHED_ROWS[-1], dtype=torch.long, device=self.device)
        self._positions = torch.zeros(GRAPHED_ROWS[-1], dtype=torch.long, device=self.device)
        self._offsets = torch.arange(GRAPHED_ROWS[-1], device=self.device)
        self.graphs = StepGraphs(self._graph_step) if graphs else None

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def prefill(self, ids: list[int], ends_prompt: bool = True) -> torch.Tensor:
        """`ends_prompt`: false for a slice of a longer prompt (a server's, scheduler.py), whose
        end is not where a retry resumes."""
        if self.graphs is not None and len(ids) == 1 and self.cache.length > 0:
            # One token after a cache (a draft model catching up): the decode step's graph.
            token = torch.tensor(ids, dtype=torch.long, device=self.device)
            return self.decode(token).clone()
        if self._graphed_rows(len(ids)):  # a draft model catching up, a short chat turn
            # A copy: the graph's output is overwritten by its next replay, and the loop keeps
            # the prompt's logits (prefill_logits).
            return self._replay_rows(ids)[-1:].clone()
        if isinstance(self.cache, RecurrentCache):
            return self._prefill_with_checkpoints(ids, self.cache, ends_prompt)
        start = 0
        for end in chunk_ends(ids, PREFILL_CHUNK):
            logits = self._pass(ids[start:end])
            start = end
        return logits

    def _pass(self, ids: list[int]) -> torch.Tensor:
        """One prefill pass of `ids` after what is cached; an image's markers among them
        (engine/image_rows.py) are looked up in the model's table of images."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        table = self.net.images
        images = None
        if table is not None:
            cache = self.cache
            images = table.resolve(ids, cache.length, cache.rope_shift, self.device, self.net.dtype)
            if images is not None and images.groups is not None:
                self.net.read_images_whole(table.encoder.bidirectional_layers)
        elif ids and min(ids) < 0:
            raise LlmcliError("this model reads text only: its prompt cannot hold an image")
        return self.net.prefill(tokens, self.cache, images)

    def _prefill_with_checkpoints(
        self, ids: list[int], cache: RecurrentCache, ends_prompt: bool
    ) -> torch.Tensor:
        """The prompt in pieces, the linear layers' states kept as checkpoints where each ends:
        where the text held ended, every multiple of the cache's interval, where an image ends,
        and one token before the prompt's end and at it (recurrent_cache.py says why there).
        One before the end: the same prompt again (a retry, another choice) must run at least
        its last token for the next one's logits, so it resumes there; a slice that does not
        end the prompt (`ends_prompt` false) has no such point, which would cost a pass of one
        token."""
        cache.checkpoint()
        start, end = cache.length, cache.length + len(ids)
        # Where each image ends: another question about the same image resumes there, rather
        # than at the interval checkpoint before (inside the image: its rows run again).
        images_end = [
            start + at for at in range(1, len(ids) + 1) if ids[at - 1] < 0 and not inside_image(ids, at)
        ]
        while cache.length < end:
            boundary = (cache.length // cache.interval + 1) * cache.interval
            last = end - 1 if ends_prompt and cache.length < end - 1 else end
            image_end = next((at for at in images_end if at > cache.length), end)
            stop = min(boundary, last, image_end)
            logits = self._pass(ids[cache.length - start : stop - start])
            cache.checkpoint()
        return logits

    @torch.inference_mode()
    def score(self, ids: list[int]) -> torch.Tensor:
        if ids and min(ids) < 0:  # drafts are sampled tokens; a scored prompt is text
            raise LlmcliError("a prompt with an image cannot be scored token by token")
        if self._graphed_rows(len(ids)):
            return self._replay_rows(ids)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.net.verify(tokens, self.cache, buckets=self.static_shapes)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        position = self.cache.length
        self.cache.ensure(position + 1)
        # After an image that moved text positions (Qwen's multimodal RoPE) the step runs eagerly:
        # a graph replays the positions of the slots it writes.
        if self.static_shapes and not self.cache.shifts:
            self._token.copy_(token.view(1))
            self._position.fill_(position)
            bucket = self.cache.bucket_for(position + 1)
            if self.graphs is not None:
                logits = self.graphs.replay(1, bucket, self.cache.storage_version)
            else:
                logits = self._bucket_step(bucket)
        else:
            logits = self.net.decode(token.view(1), position, self.cache)
        self.cache.length = position + 1
        return logits

    def _bucket_step(self, bucket: int) -> torch.Tensor:
        return self.net.decode(self._token, self._position, self.cache, bucket)

    def _graph_step(self, rows: int, bucket: int) -> torch.Tensor:
        if rows == 1:
            return self._bucket_step(bucket)
        return self.net.check_rows(self._tokens[:rows], self._positions[:rows], self.cache, bucket)

    def pass_rows(self, count: int) -> int:
        """The rows a pass of `count` tokens runs, padding included: what it costs (the
        speculative draft length is chosen by it, schedule.py)."""
        return self._graphed_rows(count) or count

    def _graphed_rows(self, count: int) -> int | None:
        """The padded row count a pass of `count` tokens replays, or None: run it eagerly."""
        if self.graphs is None or count < 2 or self.cache.shifts:
            return None
        rows = next((size for size in GRAPHED_ROWS if size >= count), None)
        if rows is None or self.cache.length + rows > self.cache.context_length:
            return None
        return rows

    @torch.inference_mode()
    def _replay_rows(self, ids: list[int]) -> torch.Tensor:
        """`ids` after what is cached, through the graph of their padded size; logits [len(ids),
        vocab]. The padding rows write past the new length, where nothing reads before it is
        overwritten, and no real row attends to them."""
        assert self.graphs is not None
        start, count = self.cache.length, len(ids)
        rows = self._graphed_rows(count)
        assert rows is not None
        self.cache.ensure(start + rows)
        self._tokens[:count].copy_(torch.tensor(ids, dtype=torch.long))
        torch.add(self._offsets[:rows], start, out=self._positions[:rows])
        bucket = self.cache.bucket_for(start + rows)
        logits = self.graphs.replay(rows, bucket, self.cache.storage_version)
        self.cache.length = start + count
        return logits[:count]

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` positions, a crop keeps (recurrent_cache.py:
        a model with a recurrent state goes back to its last checkpoint)."""
        return self.cache.resumable(length)

    def save(self) -> SavedCache | None:
        return self.cache.save()

    def restore(self, saved: SavedCache) -> None:
        self.cache.restore(saved)

    def copy_prefix(self, other: NativeBackend, length: int) -> int:
        """The first `length` positions of `other`'s cache copied into this one's (kvcache.py)."""
        return self.cache.copy_prefix(other.cache, length)

    def kv_bytes_for(self, positions: int) -> int:
        """The sequence's memory once it holds `positions` tokens: keys and values, and the
        recurrent layers' states with their checkpoints (recurrent_cache.py)."""
        return self.cache.bytes_for(positions)

    def reset(self) -> None:
        self.cache.crop(0)  # the tensors stay, and with them any captured graph

    @property
    def captures_graphs(self) -> bool:
        return self.graphs is not None

    def warm_up(self) -> float:
        """Capture the first bucket's graph now rather than in the first reply."""
        start = time.perf_counter()
        logits = self.prefill([0])
        for _ in range(2):
            logits = self.decode(logits.argmax(dim=-1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        return time.perf_counter() - start

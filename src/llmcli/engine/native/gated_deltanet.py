"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next: in place of a KV
cache, a sequence carries a fixed-size state per layer (DeltaNetState) that every token updates.

    x → in_proj → q|k|v (a causal depthwise convolution, silu), z (the output gate),
        b (β: how much a token writes), a (g: how fast the state forgets)
      → the gated delta rule over q, k, v: S ← e^g·S + k·β(v − kᵀS); out = qᵀS
      → an RMSNorm of out gated by silu(z) → out_proj

A prompt piece runs the rule in chunks of CHUNK tokens (a few matrix products per chunk, the
state carried between them); a decode step runs it once per sequence, for B sequences at once.
The arithmetic is transformers' torch reference (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`): the rule in fp32, the convolution and the norm in the
model's dtype. Nothing here reads a config or a cache object: weights and state are data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked rule: transformers' and flash-linear-attention's size. A
# piece is padded up to a multiple of it with tokens that neither write nor decay the state.
CHUNK = 64
L2_EPS = 1e-6  # q and k are l2-normalised with this epsilon (flash-linear-attention's)


# DeltaNetShape's fields, as Qwen3.5's and Qwen3-Next's configs name them.
_CONFIG_SETTINGS = {
    "key_heads": "linear_num_key_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_heads": "linear_num_value_heads",
    "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
    "eps": "rms_norm_eps",
}


@dataclass(frozen=True)
class DeltaNetShape:
    key_heads: int
    key_head_dim: int
    value_heads: int  # a multiple of key_heads: each q/k head serves that many consecutive v heads
    value_head_dim: int
    conv_kernel: int
    eps: float  # the gated norm's

    @classmethod
    def from_config(cls, config: Any) -> DeltaNetShape:
        """From a Qwen3.5 or Qwen3-Next text config (transformers' names for the settings)."""
        return cls(**{field: getattr(config, setting) for field, setting in _CONFIG_SETTINGS.items()})

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state (DeltaNetState): the convolution's window in the model's dtype,
        the rule's matrix in fp32."""
        window = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        return window + self.value_heads * self.key_head_dim * self.value_head_dim * 4


@dataclass
class DeltaNetState:
    """One layer's state for a row of sequences (one row: a single sequence). `conv` [rows,
    conv_dim, kernel − 1] holds the convolution's last inputs, in the model's dtype; `recurrent`
    [rows, value_heads, key_head_dim, value_head_dim] the rule's matrix, in fp32. A fresh
    sequence's state is zeros (`empty`). The functions below return new states and never write
    into the ones they are given, so a state kept aside stays as it was."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def empty(
        cls, shape: DeltaNetShape, dtype: torch.dtype, device: torch.device | str, rows: int = 1
    ) -> DeltaNetState:
        return cls(
            torch.zeros(rows, shape.conv_dim, shape.conv_kernel - 1, dtype=dtype, device=device),
            torch.zeros(
                rows,
                shape.value_heads,
                shape.key_head_dim,
                shape.value_head_dim,
                dtype=torch.float32,
                device=device,
            ),
        )

    @classmethod
    def stack(cls, states: list[DeltaNetState]) -> DeltaNetState:
        """Several sequences' states as the rows of one, for a batched decode step."""
        return cls(
            torch.cat([state.conv for state in states]),
            torch.cat([state.recurrent for state in states]),
        )

    def unstack(self) -> list[DeltaNetState]:
        """Each row as a state of its own (views of this one's tensors)."""
        return [
            DeltaNetState(conv[None], recurrent[None])
            for conv, recurrent in zip(self.conv, self.recurrent, strict=True)
        ]

    def clone(self) -> DeltaNetState:
        """A snapshot that shares no memory with this state (what a prefix checkpoint keeps)."""
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


Projection = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DeltaNetWeights:
    """A layer's tensors, arranged once: the four input projections fused into one matrix
    (rows q | k | v | z | b | a, whichever layout the checkpoint stores), A_log as the rate
    exp(A_log) in fp32 (transformers computes it so every pass)."""

    shape: DeltaNetShape
    # A matrix [conv_dim + value_dim + 2·value_heads, hidden], or the product by one (a
    # quantized layer's: its packed weights are not a matrix to hand to F.linear).
    in_proj: Projection
    conv: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [value_heads]
    decay_rate: torch.Tensor  # [value_heads], fp32
    norm: torch.Tensor  # [value_head_dim]
    out_proj: Projection  # [hidden, value_dim], or the product by it

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: DeltaNetShape) -> DeltaNetWeights:
        """From a layer's tensors named as transformers names them (`dict(module.named_parameters())`
        of a `…GatedDeltaNet`, or a checkpoint's under `linear_attn.`). Qwen3.5 stores in_proj_qkv,
        in_proj_z, in_proj_b, in_proj_a; Qwen3-Next in_proj_qkvz and in_proj_ba, their rows
        grouped by key head. A tensor missing, unexpected or of a shape `shape` contradicts is
        refused, named."""
        _check_names(tensors)
        if "in_proj_qkvz.weight" in tensors:
            q, k, v, z, b, a = _ungroup_qwen3_next(tensors, shape)
            qkv = torch.cat((q, k, v))
        else:
            qkv, z, b, a = (tensors[f"in_proj_{part}.weight"] for part in ("qkv", "z", "b", "a"))
        hidden = tensors["out_proj.weight"].shape[0]
        expected = {
            "in_proj_qkv": (qkv, (shape.conv_dim, hidden)),
            "in_proj_z": (z, (shape.value_dim, hidden)),
            "in_proj_b": (b, (shape.value_heads, hidden)),
            "in_proj_a": (a, (shape.value_heads, hidden)),
            "conv1d.weight": (tensors["conv1d.weight"], (shape.conv_dim, 1, shape.conv_kernel)),
            "dt_bias": (tensors["dt_bias"], (shape.value_heads,)),
            "A_log": (tensors["A_log"], (shape.value_heads,)),
            "norm.weight": (tensors["norm.weight"], (shape.value_head_dim,)),
            "out_proj.weight": (tensors["out_proj.weight"], (hidden, shape.value_dim)),
        }
        for name, (tensor, wanted) in expected.items():
            _check_shape(name, tensor, wanted)
        return cls(
            shape=shape,
            in_proj=torch.cat((qkv, z, b, a)).detach(),
            conv=tensors["conv1d.weight"].detach().squeeze(1),
            dt_bias=tensors["dt_bias"].detach(),
            decay_rate=tensors["A_log"].detach().float().exp(),
            norm=tensors["norm.weight"].detach(),
            out_proj=tensors["out_proj.weight"].detach(),
        )


_QWEN3_5_NAMES = {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}
_QWEN3_NEXT_NAMES = {"in_proj_qkvz.weight", "in_proj_ba.weight"}
_SHARED_NAMES = {"conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"}


def _check_names(tensors: Mapping[str, torch.Tensor]) -> None:
    names = set(tensors)
    layout = _QWEN3_NEXT_NAMES if "in_proj_qkvz.weight" in names else _QWEN3_5_NAMES
    wanted = layout | _SHARED_NAMES
    if missing := sorted(wanted - names):
        raise ValueError(f"Gated DeltaNet layer is missing tensor {missing[0]}")
    if unexpected := sorted(names - wanted):  # conv1d.bias, say: a setting this code would ignore
        raise ValueError(f"Gated DeltaNet layer has a tensor llmcli does not use: {unexpected[0]}")


def _check_shape(name: str, tensor: torch.Tensor, wanted: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != wanted:
        raise ValueError(
            f"Gated DeltaNet tensor {name} has shape {tuple(tensor.shape)}; the config says {wanted}"
        )


def _ungroup_qwen3_next(
    tensors: Mapping[str, torch.Tensor], shape: DeltaNetShape
) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's fused rows, per key head [q, k, v…, z…] and [b…, a…], as Qwen3.5's flat
    q, k, v, z, b, a (each head's rows in head order)."""
    qkvz, ba = tensors["in_proj_qkvz.weight"], tensors["in_proj_ba.weight"]
    groups, hidden = shape.key_heads, qkvz.shape[-1]
    per_group = shape.value_heads // groups
    widths = [shape.key_head_dim] * 2 + [per_group * shape.value_head_dim] * 2
    _check_shape("in_proj_qkvz.weight", qkvz, (groups * sum(widths), hidden))
    _check_shape("in_proj_ba.weight", ba, (2 * shape.value_heads, hidden))
    q, k, v, z = qkvz.view(groups, sum(widths), hidden).split(widths, dim=1)
    b, a = ba.view(groups, 2 * per_group, hidden).split(per_group, dim=1)
    return tuple(part.reshape(-1, hidden) for part in (q, k, v, z, b, a))


def grouped_order(shape: DeltaNetShape) -> torch.Tensor:
    """Where each of Qwen3.5's flat rows (q, k, v, z, b, a) lies among Qwen3-Next's grouped ones
    ([qkvz; ba] stacked): the index that reorders the grouped projection's outputs."""
    qkvz_rows = shape.key_heads * (2 * shape.key_head_dim + 2 * (shape.value_dim // shape.key_heads))
    rows = torch.arange(qkvz_rows + 2 * shape.value_heads)[:, None]
    names = {"in_proj_qkvz.weight": rows[:qkvz_rows], "in_proj_ba.weight": rows[qkvz_rows:]}
    return torch.cat(_ungroup_qwen3_next(names, shape))[:, 0]


# The layer ----------------------------------------------------------------------------------


def prefill(
    weights: DeltaNetWeights, hidden: torch.Tensor, state: DeltaNetState
) -> tuple[torch.Tensor, DeltaNetState]:
    """A prompt piece `hidden` [T ≥ 1, hidden] (normed, in the model's dtype) after what `state`
    (one row) has seen: the layer's output [T, hidden] and the state after the piece. Pieces
    run one after another give what the whole prompt run at once gives."""
    shape = weights.shape
    tokens = hidden.shape[0]
    if tokens == 1:  # the step's arithmetic, not a chunk of 64 padded around one token
        return decode_step(weights, hidden, state)
    mixed, z, b, a = _project(weights, hidden)
    # The convolution over the state's last inputs then the piece's: output t sees inputs
    # t−k+1..t. Inputs along the rows [k − 1 + T, conv_dim], as the projection gives them.
    window = torch.cat((state.conv[0].transpose(0, 1), mixed))
    q, k, v = _split_heads(shape, _convolved(window, weights.conv, tokens).to(hidden.dtype))
    g, beta = _gates(weights, a, b)
    # The rule per value head: [heads, T, d], as the chunks' matrix products want them.
    out, recurrent = _chunked_rule(*(x.transpose(0, 1) for x in (q, k, v, g, beta)), state.recurrent[0])
    kept = window[tokens:].transpose(0, 1).clone(memory_format=torch.contiguous_format)
    new_state = DeltaNetState(kept[None], recurrent[None])
    return _output(weights, out.transpose(0, 1).to(hidden.dtype), z, tokens), new_state


def _convolved(window: torch.Tensor, conv: torch.Tensor, tokens: int) -> torch.Tensor:
    """silu of the depthwise causal convolution of `window` [k − 1 + T, channels] by `conv`
    [channels, k]: [T, channels]. A product-sum per tap over whole rows (a grouped conv1d call
    spends more on its layout than on these few products), summed in fp32 and rounded once to
    the weights' dtype, as the convolution rounds in a half-width one."""
    taps = conv.float().t().contiguous()  # [k, channels]: each tap's weights a contiguous row
    total = window[:tokens].float() * taps[0]
    for tap in range(1, conv.shape[-1]):
        total.addcmul_(window[tap : tap + tokens], taps[tap])
    return F.silu(total.to(conv.dtype))


def decode_step(
    weights: DeltaNetWeights, hidden: torch.Tensor, states: DeltaNetState
) -> tuple[torch.Tensor, DeltaNetState]:
    """One token [B, hidden] for each of the B sequences whose states are the rows of `states`
    (DeltaNetState.stack): the outputs [B, hidden], row b what `prefill` would give for that
    token alone after its sequence, and their states after it."""
    shape = weights.shape
    rows = hidden.shape[0]
    mixed, z, b, a = _project(weights, hidden)
    window = torch.cat((states.conv, mixed[:, :, None]), dim=-1)  # [B, conv_dim, kernel]
    # The same depthwise convolution as prefill's, over the last `kernel` inputs: one output
    # each, as a product and a sum (a convolution call costs more than it computes here),
    # summed in fp32 and rounded once, as the convolution rounds in a half-width dtype.
    convolved = (window.float() * weights.conv.float()).sum(-1).to(weights.conv.dtype)
    q, k, v = _split_heads(shape, F.silu(convolved).to(hidden.dtype))
    g, beta = _gates(weights, a, b)
    q, k = _normalised(q, k)
    # The state is decayed into one new tensor that the write then lands on in place (one 1 MB
    # buffer a layer rather than three): `states` itself is never written.
    recurrent = states.recurrent * g.exp()[..., None, None]
    flat = recurrent.view(-1, *recurrent.shape[-2:])  # [B·heads, dk, dv]
    keys = k.reshape(-1, 1, k.shape[-1])
    remembered = torch.bmm(keys, flat).view(v.shape)  # what the state recalls for k
    written = (v.float() - remembered) * beta.float()[..., None]
    flat.baddbmm_(keys.transpose(-1, -2), written.view(-1, 1, written.shape[-1]))
    out = torch.bmm(q.reshape(-1, 1, q.shape[-1]), flat).view(v.shape)
    return _output(weights, out.to(hidden.dtype), z, rows), DeltaNetState(window[..., 1:], recurrent)


def _project(weights: DeltaNetWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [N, hidden] → q|k|v before the convolution [N, conv_dim], z [N, value_dim], b, a [N, value_heads]."""
    shape = weights.shape
    sizes = [shape.conv_dim, shape.value_dim, shape.value_heads, shape.value_heads]
    return _product(weights.in_proj, hidden).split(sizes, dim=-1)


def _split_heads(shape: DeltaNetShape, convolved: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, conv_dim] → q, k [N, value_heads, key_head_dim] (each key head repeated for the value
    heads it serves), v [N, value_heads, value_head_dim]."""
    rows = convolved.shape[0]
    q, k, v = convolved.split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    repeats = shape.value_heads // shape.key_heads
    q, k = (x.reshape(rows, shape.key_heads, shape.key_head_dim) for x in (q, k))
    if repeats > 1:  # a copy of each: not made where every key head serves one value head
        q, k = (x.repeat_interleave(repeats, dim=1) for x in (q, k))
    return q, k, v.reshape(rows, shape.value_heads, shape.value_head_dim)


def _gates(weights: DeltaNetWeights, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g, the log of each head's decay (≤ 0, fp32), and β in (0, 1), as transformers computes them."""
    g = -weights.decay_rate * F.softplus(a.float() + weights.dt_bias)
    return g, b.sigmoid()


def _normalised(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k l2-normalised in fp32, q also scaled by 1/√d."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q * q.shape[-1] ** -0.5, k


def _chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, CHUNK at a time. q, k [H, T, dk], v [H, T, dv], g and β
    [H, T]; `state` [H, dk, dv]. Returns the outputs [H, T, dv] (fp32) and the state after.

    Within a chunk the T sequential updates are solved at once: the values each token writes,
    corrected for what the tokens before it in the chunk wrote, come from one unit lower-
    triangular solve (the UT transform); the state read at the chunk's start is then corrected
    once, and the chunk's outputs are its read of that state plus attention within the chunk."""
    q, k = _normalised(q, k)
    v, beta = v.float(), beta.float()
    heads, length = k.shape[:2]
    pad = -length % CHUNK  # padded tokens: g = 0 (no decay), k = 0 and β = 0 (nothing written)
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).view(heads, -1, CHUNK) for x in (g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    after = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(after, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * between
    solved = torch.linalg.solve_triangular(
        system,
        torch.cat((v * beta[..., None], k_beta * decay.exp()[..., None]), dim=-1),
        upper=False,
        unitriangular=True,
    )
    values, state_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    within = (q @ k.transpose(-1, -2)) * between
    q_from_start = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    # A copy the chunks then update in place (the caller's state is left as it was): one
    # buffer, not three new ones a chunk.
    state = state.float().clone()
    out = values.new_empty(values.shape)
    for i in range(values.shape[1]):
        corrected = values[:, i] - state_keys[:, i] @ state
        out[:, i] = torch.baddbmm(q_from_start[:, i] @ state, within[:, i], corrected)
        state.mul_(chunk_decay[:, i]).baddbmm_(k_to_end[:, i].transpose(-1, -2), corrected)
    return out.view(heads, -1, v.shape[-1])[:, :length], state


def _output(weights: DeltaNetWeights, out: torch.Tensor, z: torch.Tensor, rows: int) -> torch.Tensor:
    """The rule's output [N, heads, dv] → RMSNorm per head, gated by silu(z), → out_proj [N, hidden]
    (transformers' RMSNormGated: normed in fp32, scaled in the model's dtype, gated in fp32)."""
    dtype = out.dtype
    z = z.reshape(out.shape)
    normed = F.rms_norm(out.float(), (out.shape[-1],), eps=weights.shape.eps).to(dtype)
    gated = (weights.norm * normed) * F.silu(z.float())
    return _product(weights.out_proj, gated.to(dtype).reshape(rows, -1))


def _product(projection: Projection, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, projection) if isinstance(projection, torch.Tensor) else projection(x)

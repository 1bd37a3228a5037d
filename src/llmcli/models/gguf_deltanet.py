"""Qwen3.5's GGUF files (llama.cpp's `qwen35`, and `qwen35moe` and `qwen3next` for Qwen3.5-MoE
and Qwen3-Next) as llama.cpp's converter writes them, undone to transformers' layout, so that the
lean model and transformers' path read them as a folder's.

llama.cpp's convert_hf_to_gguf.py (Qwen3NextModel and _LinearAttentionVReorderBase) changes a
Qwen3.5 checkpoint on its way into the file:

- every RMSNorm weight but the DeltaNet's own gated norm is stored plus one (llama.cpp multiplies
  by the weight; Qwen3.5's norm multiplies by 1 + weight): one is taken off again;
- A_log is stored as `ssm_a` = −exp(A_log): read back as log(−ssm_a);
- the convolution's [channels, 1, kernel] weight is stored squeezed to [channels, kernel];
- `dt_bias` is stored as the bias of a `dt_proj` there is no weight of (`ssm_dt.bias`);
- where a key head serves several value heads, the value heads are stored "tiled" ([K0v0, K1v0,
  …, K0v1, K1v1, …]) rather than grouped by key head as transformers holds them ([K0v0, K0v1, …,
  K1v0, …]): in in_proj_qkv's value rows, in_proj_z, in_proj_a/b, A_log, dt_bias, the
  convolution's value channels and out_proj's columns. They are put back in groups.

Qwen3-Next's files (Qwen3NextModel alone, no value heads reordered) hold its `in_proj_qkvz`,
whose rows transformers groups per key head ([q, k, v, z] of key head 0, then of 1, …), as two
matrices: `attn_qkv` (every head's q, then every k, then every v) and `attn_gate` (every z); put
back together here. Its `in_proj_ba` is stored as it is (`ssm_ba`).

The experts of either MoE are stored stacked, one tensor each for gate, up and down
(`ffn_*_exps`, [experts, out, in]), the router as `ffn_gate_inp`, the shared expert as
`ffn_*_shexp` and its gate as `ffn_gate_inp_shexp`; gate and up are joined here as transformers
5 holds them (`mlp.experts.gate_up_proj`).

The full-attention layers are stored as transformers holds them (q_proj keeps each head's query
and gate side by side; no rotary interleave), their norms plus one as above. Metadata names the
DeltaNet's sizes llama.cpp's way (`ssm.*`), mapped here to transformers' settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# A block's tensors, by their name in the file (within `blk.N.`), → transformers' name within
# `model.layers.N.`.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen3.5-MoE's and Qwen3-Next's experts (the routed ones' gate and up joined below).
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",  # Qwen3-Next's
}
# transformers' tensors the file holds in parts (their names within a layer → the parts'), joined
# on reading: where every part is there, and, for Qwen3-Next's projections, only in its files.
JOINED = {"mlp.experts.gate_up_proj": ("mlp.experts.gate_proj", "mlp.experts.up_proj")}
GROUPED_JOINED = {
    "linear_attn.in_proj_qkvz.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")
}

# What a layer of each kind must hold, as llama.cpp's loader requires it: its attention's or
# DeltaNet's tensors (Qwen3-Next's input projections in its own three), and its dense MLP's or,
# in the MoE files (every layer sparse), the experts'.
_EVERY_LAYER = ("attn_norm.weight", "post_attention_norm.weight")
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_SPARSE = (
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
    "ffn_gate_inp_shexp.weight",
)
_ATTENTION = (
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
)
_DELTANET = ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight")
_PROJECTIONS = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")
_GROUPED_PROJECTIONS = ("attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight")


def required(kind: str, sparse: bool, grouped: bool) -> tuple[str, ...]:
    """The tensors a block of `kind` ("full_attention" or "linear_attention") must hold: with
    experts where `sparse`, with Qwen3-Next's projections where `grouped`."""
    ffn = _SPARSE if sparse else _DENSE
    if kind == "full_attention":
        return (*_EVERY_LAYER, *ffn, *_ATTENTION)
    return (*_EVERY_LAYER, *ffn, *(_GROUPED_PROJECTIONS if grouped else _PROJECTIONS), *_DELTANET)


# The norms stored plus one (transformers' names, within a layer or at the top).
_PLUS_ONE = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


@dataclass(frozen=True)
class DeltaNetSizes:
    """The DeltaNet's sizes as a file's metadata gives them, in transformers' terms."""

    key_heads: int
    key_head_dim: int
    value_heads: int
    value_head_dim: int
    conv_kernel: int
    # The value heads stored tiled (llama.cpp's Qwen3.5 converters), or grouped as transformers
    # holds them (its Qwen3-Next one).
    tiled: bool = True

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def per_key(self) -> int:
        """The value heads each key head serves."""
        return self.value_heads // self.key_heads


def sizes_of(key: Any, tiled: bool = True) -> tuple[DeltaNetSizes | None, str | None]:
    """The DeltaNet's sizes from the metadata (`key(name)`: the value of `{arch}.{name}`), or
    None and what in them contradicts itself (a key missing, or a size that is no whole number
    of heads), naming the key. `tiled`: as DeltaNetSizes.tiled."""
    names = ("ssm.group_count", "ssm.state_size", "ssm.time_step_rank", "ssm.inner_size", "ssm.conv_kernel")
    values = {name: key(name) for name in names}
    missing = [name for name, value in values.items() if not isinstance(value, int) or value <= 0]
    if missing:
        return None, f"its metadata lacks a positive {', '.join(missing)}"
    groups, state, rank, inner, kernel = (int(values[name]) for name in names)
    if rank % groups:
        return (
            None,
            f"its ssm.time_step_rank ({rank} value heads) is no multiple of ssm.group_count ({groups})",
        )
    if inner % rank:
        return None, f"its ssm.inner_size ({inner}) is no whole number of its {rank} value heads"
    return DeltaNetSizes(groups, state, rank, inner // rank, kernel, tiled), None


def layout_problem(key: Any, head_dim: int, layers: int) -> str | None:
    """What in the metadata's layer count, layer pattern or RoPE width no Qwen3.5 has, naming
    the key (a zero interval would make no layer full attention, a rotated width past the head
    rotate what is not there); None where all are sound. `layers`: the model's own blocks."""
    if layers <= 0:
        return f"its nextn_predict_layers ({key('nextn_predict_layers')}) leaves no block of the model"
    interval = key("full_attention_interval", 4)
    if not isinstance(interval, int) or interval <= 0:
        return f"its full_attention_interval ({interval!r}) is no positive whole number of layers"
    rotated = key("rope.dimension_count", head_dim)
    if not isinstance(rotated, int) or rotated <= 0 or rotated % 2 or rotated > head_dim:
        return f"its rope.dimension_count ({rotated!r}) is no even part of a head's {head_dim} dimensions"
    return None


# transformers' model_type of each architecture's files (AutoConfig reads the folder by it).
MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
# The MoE files' expert settings: the key (within `{arch}.`) → transformers' setting.
EXPERT_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def config_fields(key: Any, sizes: DeltaNetSizes, head_dim: int, layers: int) -> dict[str, Any]:
    """config.json's fields for a Qwen3.5 file beyond a Llama's: its DeltaNet's sizes, its layer
    kinds (every `full_attention_interval`-th layer full attention, as llama.cpp reads them) and
    the part of each head RoPE turns."""
    interval = int(key("full_attention_interval", 4))
    rotated = int(key("rope.dimension_count", head_dim))
    return {
        "linear_num_key_heads": sizes.key_heads,
        "linear_key_head_dim": sizes.key_head_dim,
        "linear_num_value_heads": sizes.value_heads,
        "linear_value_head_dim": sizes.value_head_dim,
        "linear_conv_kernel_dim": sizes.conv_kernel,
        "full_attention_interval": interval,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
        ],
        "partial_rotary_factor": rotated / head_dim,
    }


def expert_fields(key: Any, grouped: bool) -> tuple[dict[str, Any] | None, str | None]:
    """config.json's expert settings of a MoE file (every layer sparse, its router's top-k
    renormalised, as llama.cpp runs both), or None and the key missing or not a positive count."""
    values = {name: key(name) for name in EXPERT_KEYS}
    bad = [name for name, value in values.items() if type(value) is not int or value <= 0]
    if bad:
        return None, f"its metadata lacks a positive {', '.join(bad)}"
    if values["expert_used_count"] > values["expert_count"]:
        return None, (
            f"its expert_used_count ({values['expert_used_count']}) is more than its "
            f"expert_count ({values['expert_count']})"
        )
    fields = {setting: values[name] for name, setting in EXPERT_KEYS.items()}
    if grouped:  # Qwen3-Next's config: no dense layer, top-k renormalised
        fields |= {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}
    return fields, None


def expected_shapes(config: dict[str, Any], sizes: DeltaNetSizes) -> dict[str, tuple[int, ...]]:
    """A block's tensors' shapes (torch's order) its metadata implies, by their name in the file."""
    hidden, inner, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    queries, keys = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    shapes = {
        "attn_norm.weight": (hidden,),
        "post_attention_norm.weight": (hidden,),
        "attn_q.weight": (2 * queries, hidden),  # each head's query, then its gate
        "attn_k.weight": (keys, hidden),
        "attn_v.weight": (keys, hidden),
        "attn_output.weight": (hidden, queries),
        "attn_q_norm.weight": (head,),
        "attn_k_norm.weight": (head,),
        "attn_qkv.weight": (sizes.conv_dim, hidden),
        "attn_gate.weight": (sizes.value_dim, hidden),
        "ssm_beta.weight": (sizes.value_heads, hidden),
        "ssm_alpha.weight": (sizes.value_heads, hidden),
        "ssm_conv1d.weight": (sizes.conv_dim, sizes.conv_kernel),
        "ssm_dt.bias": (sizes.value_heads,),
        "ssm_a": (sizes.value_heads,),
        "ssm_norm.weight": (sizes.value_head_dim,),
        "ssm_out.weight": (hidden, sizes.value_dim),
        "ffn_gate.weight": (inner, hidden),
        "ffn_up.weight": (inner, hidden),
        "ffn_down.weight": (hidden, inner),
        "ssm_ba.weight": (2 * sizes.value_heads, hidden),  # each key head's b, then its a
    }
    if "num_experts" in config:
        experts, width = config["num_experts"], config["moe_intermediate_size"]
        shared = config["shared_expert_intermediate_size"]
        shapes |= {
            "ffn_gate_inp.weight": (experts, hidden),
            "ffn_gate_exps.weight": (experts, width, hidden),
            "ffn_up_exps.weight": (experts, width, hidden),
            "ffn_down_exps.weight": (experts, hidden, width),
            "ffn_gate_shexp.weight": (shared, hidden),
            "ffn_up_shexp.weight": (shared, hidden),
            "ffn_down_shexp.weight": (hidden, shared),
            "ffn_gate_inp_shexp.weight": (1, hidden),  # transformers' [1, hidden], as converted
        }
    return shapes


# The settings each DeltaNet tensor's shape comes from, named where a file contradicts them.
IMPLIED_BY = {
    "ssm_conv1d.weight": "ssm.conv_kernel, ssm.group_count, ssm.state_size and ssm.inner_size",
    "attn_qkv.weight": "ssm.group_count, ssm.state_size and ssm.inner_size",
    "attn_gate.weight": "ssm.inner_size",
    "ssm_out.weight": "ssm.inner_size",
    "ssm_beta.weight": "ssm.time_step_rank",
    "ssm_alpha.weight": "ssm.time_step_rank",
    "ssm_dt.bias": "ssm.time_step_rank",
    "ssm_a": "ssm.time_step_rank",
    "ssm_norm.weight": "ssm.inner_size / ssm.time_step_rank",
    "ssm_ba.weight": "ssm.time_step_rank",
    "ffn_gate_inp.weight": "expert_count",
    "ffn_gate_exps.weight": "expert_count and expert_feed_forward_length",
    "ffn_up_exps.weight": "expert_count and expert_feed_forward_length",
    "ffn_down_exps.weight": "expert_count and expert_feed_forward_length",
    "ffn_gate_shexp.weight": "expert_shared_feed_forward_length",
    "ffn_up_shexp.weight": "expert_shared_feed_forward_length",
    "ffn_down_shexp.weight": "expert_shared_feed_forward_length",
}


# The shared expert's one-row gate: the converter stores it as transformers' [1, hidden], but
# llama.cpp's quantizer writes it back as a vector (ggml drops the trailing 1); either is read.
_SHARED_GATE = ("ffn_gate_inp_shexp.weight", "shared_expert_gate.weight")


def fits(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether the file's tensor `name` (its name within a block) of `shape` is of the shape
    its metadata implies (`expected`), the shared expert's gate as a vector too."""
    return shape == expected or (name == _SHARED_GATE[0] and shape == expected[1:])


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape transformers holds the tensor `name` (its name) in."""
    if name.endswith(_SHARED_GATE[1]) and len(shape) == 1:
        return (1, *shape)
    return (shape[0], 1, shape[1]) if name.endswith("conv1d.weight") else shape


def changed_on_store(name: str, sizes: DeltaNetSizes) -> bool:
    """Whether the file holds the matrix `name` (transformers' name) otherwise than transformers
    does: its quantized blocks cannot be taken as they are."""
    if not sizes.tiled:  # Qwen3-Next's: its qkv and z matrices are read only as in_proj_qkvz's parts
        return name.endswith(GROUPED_JOINED[_QKVZ])
    regrouped = sizes.per_key > 1 and ".linear_attn." in name
    return regrouped and not name.endswith(("norm.weight", "dt_bias", "A_log"))


def restore(name: str, tensor: torch.Tensor, sizes: DeltaNetSizes) -> torch.Tensor:
    """The tensor `name` (transformers' name) as transformers holds it, from the file's `tensor`
    (its values, in fp32 or the file's float type)."""
    import torch

    leaf = name.rsplit(".", 2)
    if name.endswith(_SHARED_GATE[1]):
        return tensor.reshape(hf_shape(name, tuple(tensor.shape)))
    if name == "model.norm.weight" or (name.endswith(".weight") and leaf[-2] in _PLUS_ONE):
        return tensor.float() - 1  # in fp32 whatever the file's type: no second rounding
    if ".linear_attn." not in name:
        return tensor
    part = leaf[-1] if leaf[-1] != "weight" else leaf[-2]
    if part == "A_log":
        tensor = torch.log(-tensor.float()).to(tensor.dtype)
    if sizes.per_key == 1 or not sizes.tiled:
        return tensor[:, None] if part == "conv1d" else tensor
    if part in ("in_proj_qkv", "conv1d"):  # q's and k's rows as they are, then the value heads'
        split = 2 * sizes.key_heads * sizes.key_head_dim
        rows = torch.cat((tensor[:split], _grouped(tensor[split:], sizes, sizes.value_head_dim)))
        return rows[:, None] if part == "conv1d" else rows
    if part == "in_proj_z":
        return _grouped(tensor, sizes, sizes.value_head_dim)
    if part in ("in_proj_a", "in_proj_b", "A_log", "dt_bias"):
        return _grouped(tensor, sizes, 1)
    if part == "out_proj":
        return _grouped(tensor.T, sizes, sizes.value_head_dim).T.contiguous()
    return tensor


_QKVZ = "linear_attn.in_proj_qkvz.weight"


def joined(name: str, parts: list[torch.Tensor], sizes: DeltaNetSizes) -> torch.Tensor:
    """transformers' tensor `name` (a JOINED or GROUPED_JOINED one) from its parts as the file
    holds them: the experts' gate and up stacked as [experts, 2 × width, hidden]; Qwen3-Next's
    in_proj_qkvz with its rows grouped per key head again (the converter's split undone)."""
    import torch

    if not name.endswith(_QKVZ):
        return torch.cat(parts, dim=1)
    qkv, z = parts
    heads, key_dim = sizes.key_heads, sizes.key_head_dim
    values = sizes.per_key * sizes.value_head_dim  # each key head's value (and z) rows
    q, k, v = torch.split(qkv, [heads * key_dim, heads * key_dim, heads * values])
    grouped = [part.reshape(heads, -1, qkv.shape[1]) for part in (q, k, v, z)]
    return torch.cat(grouped, dim=1).reshape(-1, qkv.shape[1])


def joined_shape(name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of `joined(name, parts)` for parts of `shapes`."""
    if name.endswith(_QKVZ):
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])
    return (shapes[0][0], sum(shape[1] for shape in shapes), *shapes[0][2:])


def _grouped(rows: torch.Tensor, sizes: DeltaNetSizes, width: int) -> torch.Tensor:
    """Rows of value heads (`width` rows each) from llama.cpp's tiled order back to transformers'
    grouped one: [per_key, key_heads, width] → [key_heads, per_key, width]."""
    rest = rows.shape[1:]
    tiled = rows.reshape(sizes.per_key, sizes.key_heads, width, *rest)
    return tiled.transpose(0, 1).reshape(rows.shape).contiguous()

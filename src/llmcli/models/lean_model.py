"""A Llama-family checkpoint's tensors in the module layout the native engine reads, built from
the safetensors files alone: no transformers model, no modeling code imported.

The modules are plain torch ones under transformers' attribute names (`model.layers[i].self_attn
.q_proj`, `mlp.gate_proj`, `lm_head`, …), so the native family code (engine/native/families/
llama.py) and llmcli's quantizer (models/quantized.py) take this model as they take
transformers' — one engine and one quantizer, whichever loader ran. It has no forward of its
own: only the native engine runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import nn

from llmcli.errors import ModelLoadError
from llmcli.models.deltanet_layout import deltanet_tensors
from llmcli.models.families import Family
from llmcli.models.lean_config import DamagedCheckpoint, LeanConfig, LeanUnsupported, rope_frequencies
from llmcli.models.lean_modules import Norm
from llmcli.models.lean_modules import fits_the_stream as _fits_the_stream
from llmcli.models.lean_modules import linear as _linear
from llmcli.models.tensor_file import TensorFile

# The architectures whose checkpoints this module reads are the rows of families.py: the Llama
# family's layout, with what each row says its config implies beyond the weights (biases, q/k
# norms, Gemma's norms around the MLP, sinks, experts). A checkpoint without a tensor its config
# implies is damaged (transformers' path names it in one line), not a model without it.
_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})


class Rotary:
    """What the family code reads of transformers' rotary embedding."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling


class LeanCausalLM(nn.Module):
    def __init__(self, config: LeanConfig, body: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.architecture = config.architectures[0]
        self.model = body
        self.lm_head = lm_head
        self.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def get_input_embeddings(self) -> nn.Module:
        """An nn.Embedding, or a GGUF file's table kept in its blocks (gguf_embedding.py)."""
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


class Tensors:
    """The checkpoint's tensors by name, across its shards, each read when asked for (nothing
    before; tensor_file.py says why not through a mapping of the files)."""

    # The config is the checkpoint's own: a tensor it implies and the files lack is refused.
    implied_required = True

    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype,
        device: torch.device,
        headers: Mapping[Path, dict[str, Any] | None] | None = None,
    ) -> None:
        """`headers`: each safetensors file's header by its path, where read already (the
        checkpoint's); else the folder's files are read here."""
        self.dtype, self.device = dtype, device
        if headers is None:
            headers = {path: None for path in sorted(folder.glob("*.safetensors"))}
        files = [TensorFile(path, header) for path, header in headers.items()]
        self._where = {name: file for file in files for name in file.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _file_of(self, name: str) -> TensorFile:
        file = self._where.get(name)
        if file is None:
            raise DamagedCheckpoint(f"a checkpoint without the tensor {name}")
        return file

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the model's dtype, or in `dtype` where given (as stored: uint8)."""
        file = self._file_of(name)
        try:
            tensor = file.get(name)
        except ValueError as error:
            raise LeanUnsupported(f"its tensor {name} ({error})") from None
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None

    def stand_in(self, name: str) -> torch.Tensor:
        """The tensor's shape and dtype and no values: one zero seen at every position (not a
        meta tensor, whose operations would import torch's compiler: 1.2 s)."""
        shape = self._file_of(name).shape(name)
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)

    def embedding(self, name: str, packed: bool) -> nn.Module:
        return nn.Embedding.from_pretrained(self.get(name), freeze=True)  # no random init first

    def rope_factors(self) -> torch.Tensor | None:
        return None  # a folder's config says its RoPE scaling itself


class TensorSource(Protocol):
    """Where the weights come from, by transformers' names: a folder's safetensors (`Tensors`),
    or a GGUF file read in place (gguf_direct.GGUFTensors)."""

    dtype: torch.dtype
    device: torch.device
    # Whether a tensor the config implies must be there (a folder's config.json), or is read where
    # present (a config llmcli wrote from the file's own tensors: a GGUF file).
    implied_required: bool

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def optional(self, name: str) -> torch.Tensor | None: ...

    def stand_in(self, name: str) -> torch.Tensor: ...

    def embedding(self, name: str, packed: bool) -> nn.Module:
        """The embedding's module; `packed`: the model's layers are quantized on a CPU, where
        a quantized table may stay in its own blocks."""
        ...

    def rope_factors(self) -> torch.Tensor | None: ...


def check_computes(config: LeanConfig) -> Family:
    """The config's family row, or LeanUnsupported naming what the native engine does not compute
    for it (its architecture, activation or RoPE). Asked before any weight is read
    (build_native.choose), and again by `build` for its other callers."""
    row = config.family
    if row is None:
        raise LeanUnsupported(f"its architecture {config.architectures[0]}")
    field, expected = row.activation
    activation = getattr(config, field)
    if activation != expected:
        raise LeanUnsupported(f"its activation {activation!r}")
    for kind, rope in config.rope_parameters.items() if row.rope_per_kind else ((None, None),):
        rope_frequencies(config.for_kind(kind), rope)
    return row


def build(
    tensors: TensorSource,
    config: LeanConfig,
    stand_ins: frozenset[str] = frozenset(),
    packed: bool = False,
    mtp: bool = False,
) -> LeanCausalLM:
    """The model from `tensors`, in their dtype on their device. `stand_ins`: linear layers
    (by module name) whose weights are never read, because the quantizer reads them from a GGUF
    file's blocks (its 4-bit codes as they are, the others into int8): they get stand-ins of
    their shape (`is_stand_in`), which the quantizer replaces. `packed`: the quantizer will run,
    on a CPU (TensorSource.embedding). `mtp`: the checkpoint's multi-token-prediction module
    (`mtp.*`, Qwen3.5's) is read too, as `model.mtp`, for --speculative mtp; it is left unread
    otherwise (transformers drops it too)."""
    row = check_computes(config)
    device = tensors.device
    rotary = _gemma_rotary(config, device) if row.rope_per_kind else _rotary(tensors, config, device)
    embed_name = "model.embed_tokens.weight"
    body = nn.Module()
    body.embed_tokens = tensors.embedding(embed_name, packed)
    if row.embed_scale:  # what transformers' scaled embedding says it multiplies its rows by
        body.embed_tokens.scalar_embed_scale = config.hidden_size**0.5
    if row.layer_types == "gemma4":  # its own layer layout (KV shared, per-layer inputs, experts)
        from llmcli.models.lean_gemma4 import build_layers

        build_layers(tensors, config, body)
    else:
        body.layers = nn.ModuleList(
            _layer(tensors, f"model.layers.{i}", stand_ins, config, row)
            for i in range(config.num_hidden_layers)
        )
    body.norm = Norm(tensors.get("model.norm.weight", _norm_dtype(tensors, row, "norm")))
    body.rotary_emb = rotary
    head_name = embed_name if config.tie_word_embeddings else "lm_head.weight"
    if "lm_head" in stand_ins:  # the quantizer reads it from the file: never read here
        lm_head = _linear(tensors.stand_in(head_name), None)
    elif config.tie_word_embeddings and isinstance(body.embed_tokens, nn.Embedding):
        lm_head = _linear(body.embed_tokens.weight, None)  # one tensor, as transformers ties them
    else:  # a tied table kept packed is read again for the head (which the quantizer replaces);
        # an untied head that is absent is refused: transformers' path names the missing tensor
        lm_head = _linear(tensors.get(head_name), None)
    model = LeanCausalLM(config, body, lm_head)
    if mtp:
        model.mtp = _mtp_module(tensors, config, row, stand_ins)
    return model


def _mtp_module(
    tensors: TensorSource, config: LeanConfig, row: Family, stand_ins: frozenset[str]
) -> nn.Module:
    """Qwen3.5's MTP module under the checkpoint's own names (engine/native/mtp.py says what it
    computes): `fc` [hidden, 2 × hidden], its three norms, and one full-attention decoder layer
    as the body's (`layers[0]`, its q_proj doubled with the gate; in Qwen3.5-MoE and Qwen3-Next,
    the body's experts and shared expert, as `_layer` reads them). A checkpoint with more than
    one such layer is refused naming it: the drafter runs one."""
    if "mtp.layers.1.input_layernorm.weight" in tensors:
        raise LeanUnsupported("an MTP module of more than one layer (mtp.layers.1)")
    module = nn.Module()
    fc = tensors.get("mtp.fc.weight")
    if list(fc.shape) != [config.hidden_size, 2 * config.hidden_size]:
        raise DamagedCheckpoint(f"a checkpoint whose tensor mtp.fc.weight has the shape {list(fc.shape)}")
    module.fc = _linear(fc, None)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        setattr(module, name, Norm(tensors.get(f"mtp.{name}.weight")))
    layer = _layer(tensors, "mtp.layers.0", stand_ins, config, row, full_attention=True)
    module.layers = nn.ModuleList([layer])
    return module


def _norm_dtype(tensors: TensorSource, row: Family, name: str) -> torch.dtype | None:
    """fp32 for a norm its family keeps so in an fp16 model; None: the model's dtype."""
    kept = name in row.fp32_norms
    return torch.float32 if kept and tensors.dtype == torch.float16 else None


def _rotary(tensors: TensorSource, config: LeanConfig, device: torch.device) -> Rotary:
    inv_freq, scaling = rope_frequencies(config)
    factors = tensors.rope_factors()
    if factors is not None:  # a GGUF file's Llama 3.1-style scaling, as llama.cpp applies it
        if factors.shape != inv_freq.shape:
            raise LeanUnsupported(
                f"its rope_freqs tensor of {factors.numel()} factors for {inv_freq.numel()} frequencies"
            )
        inv_freq = inv_freq / factors.to(inv_freq.dtype)
    return Rotary(inv_freq.to(device), scaling)


def _gemma_rotary(config: LeanConfig, device: torch.device) -> SimpleNamespace:
    """Gemma 3's tables, one per kind of layer, under the names its rotary embedding gives them
    (`sliding_attention_inv_freq`, …): a local base for the sliding layers, the global one with
    its scaling for the others."""
    tables = SimpleNamespace()
    for kind, rope in config.rope_parameters.items():
        inv_freq, scaling = rope_frequencies(config.for_kind(kind), rope)
        setattr(tables, f"{kind}_inv_freq", inv_freq.to(device))
        setattr(tables, f"{kind}_attention_scaling", scaling)
    return tables


def _has_bias(config: LeanConfig, row: Family, projection: str) -> bool:
    """Whether transformers' module for `projection` (q_proj, …, down_proj) has a bias."""
    if row.biases == "none":
        return False
    if row.biases == "qkv":
        return projection in ("q_proj", "k_proj", "v_proj")
    if projection in _MLP:
        return row.biases == "attention+mlp" and bool(config.mlp_bias)
    return bool(config.attention_bias)


def _implied(tensors: TensorSource, name: str, implied: bool) -> torch.Tensor | None:
    """A tensor beyond the weights. Where the config is the checkpoint's own: read where it
    implies one (a missing one raises DamagedCheckpoint naming it), and not where it does not,
    as transformers' modules leave such a tensor unused. Elsewhere (a GGUF file): read where
    present."""
    if not tensors.implied_required:
        return tensors.optional(name)
    return tensors.get(name) if implied else None


def _layer(
    tensors: TensorSource,
    prefix: str,
    stand_ins: frozenset[str],
    config: LeanConfig,
    row: Family,
    full_attention: bool = False,
) -> nn.Module:
    """One decoder layer; `full_attention`: whatever the config's layer kinds say at its index
    (an MTP module's layer, which the body's kinds do not list)."""

    def linear(name: str) -> nn.Linear:
        module = f"{prefix}.{name}"
        read = tensors.stand_in if module in stand_ins else tensors.get
        weight = read(f"{module}.weight")
        _fits_the_stream(f"{module}.weight", weight, config.hidden_size)
        bias = _implied(tensors, f"{module}.bias", _has_bias(config, row, name.rsplit(".", 1)[-1]))
        return _linear(weight, bias)

    layer = nn.Module()
    for name in ("input_layernorm", "post_attention_layernorm"):
        setattr(layer, name, Norm(tensors.get(f"{prefix}.{name}.weight", _norm_dtype(tensors, row, name))))
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # Gemma's norms around the MLP
        weight = _implied(tensors, f"{prefix}.{name}.weight", row.ffn_norms)
        if weight is not None:
            setattr(layer, name, Norm(weight))
    kinds, index = config.layer_types, int(prefix.rsplit(".", 1)[-1])
    if row.layer_types == "linear" and kinds[index] == "linear_attention" and not full_attention:
        layer.linear_attn = _linear_attention(tensors, f"{prefix}.linear_attn", row, linear)
    else:
        layer.self_attn = _attention(tensors, prefix, config, row, linear)
    experts = _gpt_oss_experts(tensors, prefix, config, row) or _experts(tensors, prefix, config, row)
    if experts is not None:
        if row.shared_expert:  # beside the routed experts, under transformers' names
            experts.shared_expert = nn.Module()
            for name in _MLP:
                setattr(experts.shared_expert, name, linear(f"mlp.shared_expert.{name}"))
            experts.shared_expert_gate = linear("mlp.shared_expert_gate")
        layer.mlp = experts
        return layer
    mlp = nn.Module()
    fused_gate_up = f"{prefix}.mlp.gate_up_proj.weight" in tensors  # Phi-3
    for name in ("gate_up_proj", "down_proj") if fused_gate_up else ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, linear(f"mlp.{name}"))
    layer.mlp = mlp
    return layer


def _linear_attention(
    tensors: TensorSource, prefix: str, row: Family, linear: Callable[[str], nn.Linear]
) -> nn.Module:
    """A Gated DeltaNet layer under the names transformers' module gives its parts, which the
    engine reads by name (gated_deltanet.DeltaNetWeights checks their shapes): its projections
    linear layers, as transformers has them (so --quant quantizes them as any other)."""
    module = nn.Module()
    for name in deltanet_tensors(row):
        holder, _, leaf = name.rpartition(".")
        if holder.startswith(("in_proj", "out_proj")):
            setattr(module, holder, linear(f"linear_attn.{holder}"))
            continue
        parameter = nn.Parameter(tensors.get(f"{prefix}.{name}"), requires_grad=False)
        if holder:
            setattr(module, holder, nn.Module())
            getattr(module, holder).register_parameter(leaf, parameter)
        else:
            module.register_parameter(leaf, parameter)
    return module


def _attention(
    tensors: TensorSource, prefix: str, config: LeanConfig, row: Family, linear: Callable[[str], nn.Linear]
) -> nn.Module:
    attention = nn.Module()
    fused_qkv = f"{prefix}.self_attn.qkv_proj.weight" in tensors  # Phi-3
    for name in ("qkv_proj", "o_proj") if fused_qkv else ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attention, name, linear(f"self_attn.{name}"))
    for name in ("q_norm", "k_norm"):  # Qwen3, Gemma 3
        weight = _implied(tensors, f"{prefix}.self_attn.{name}.weight", row.head_norms)
        if weight is not None:
            setattr(attention, name, Norm(weight))
    sinks = _implied(tensors, f"{prefix}.self_attn.sinks", row.sinks)  # a logit per head
    if sinks is not None:
        attention.sinks = nn.Parameter(sinks, requires_grad=False)
    return attention


def _experts(tensors: Tensors, prefix: str, config: LeanConfig, row: Family) -> nn.Module | None:
    """A sparse layer's router and experts as transformers 5 holds them (which the native MoE
    family and the quantizer read): gate and up stacked as [experts, 2 × intermediate, hidden],
    down as [experts, hidden, intermediate] — restacked from the checkpoint's one tensor per
    expert, as transformers' loader restacks them, from where the family's row says they are;
    None for a dense layer (no router) or a family without such experts."""
    if row.expert_layout is None:
        return None
    place, (gate, up, down) = row.expert_layout
    router = f"{prefix}.{place}.gate.weight"
    if router not in tensors:
        return None
    block = f"{prefix}.{place}.experts"
    moe, routing, experts = nn.Module(), nn.Module(), nn.Module()
    routing.weight = nn.Parameter(tensors.get(router), requires_grad=False)
    routing.top_k = config.num_experts_per_tok
    count = routing.weight.shape[0]
    if f"{block}.gate_up_proj" in tensors:  # stored stacked already (Qwen3.5-MoE's release)
        gate_up, downs = _stored_stacked(tensors, block, count)
    else:
        gate_up, downs = _stacked(tensors, block, count, (gate, up), down)
    for name, weight in (
        (f"{block}.gate_up_proj", gate_up),
        (f"{block}.down_proj", downs),
        (router, routing.weight),
    ):
        _fits_the_stream(name, weight, config.hidden_size)
    experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = nn.Parameter(downs, requires_grad=False)
    moe.gate, moe.experts = routing, experts
    return moe


def _stored_stacked(tensors: TensorSource, block: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's experts as a checkpoint in transformers 5's layout stores them (`experts.
    gate_up_proj` [count, 2 × intermediate, hidden], `experts.down_proj` [count, hidden,
    intermediate]), read as they are; a count or width the two disagree on is refused naming them."""
    gate_up, downs = tensors.get(f"{block}.gate_up_proj"), tensors.get(f"{block}.down_proj")
    fits = gate_up.dim() == downs.dim() == 3 and gate_up.shape[0] == downs.shape[0] == count
    if not fits or gate_up.shape[1] != 2 * downs.shape[2]:
        raise DamagedCheckpoint(
            f"a checkpoint whose tensors {block}.gate_up_proj {list(gate_up.shape)} and "
            f"{block}.down_proj {list(downs.shape)} are not {count} experts' gate/up and down"
        )
    return gate_up, downs


def _stacked(
    tensors: Tensors, block: str, count: int, gate_up: tuple[str, str], down: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gate and up matrices as one [count, 2 × intermediate, hidden] tensor and
    their down ones as [count, hidden, intermediate], filled expert by expert (a layer's experts
    are held once, plus one expert's matrix in passing). An expert of another shape than the
    first is refused in one line naming it (transformers' loader says only that its conversion
    failed)."""

    def read(expert: int, name: str, shape: torch.Size | None) -> torch.Tensor:
        tensor = f"{block}.{expert}.{name}.weight"
        weight = tensors.get(tensor)
        if shape is not None and weight.shape != shape:
            raise ModelLoadError(
                f"the checkpoint's tensor {tensor} has the shape {list(weight.shape)}, "
                f"where expert 0's has {list(shape)}",
                "the checkpoint is damaged or not for this config: download it again",
            )
        return weight

    first = read(0, gate_up[0], None)
    rows = first.shape[0]
    stacked = first.new_empty((count, 2 * rows, first.shape[1]))
    for expert in range(count):
        for half, name in enumerate(gate_up):
            matrix = first if expert == half == 0 else read(expert, name, first.shape)
            stacked[expert, half * rows : (half + 1) * rows] = matrix
    first_down = read(0, down, None)
    downs = first_down.new_empty((count, *first_down.shape))
    for expert in range(count):
        downs[expert] = first_down if expert == 0 else read(expert, down, first_down.shape)
    return stacked, downs


def _gpt_oss_experts(tensors: TensorSource, prefix: str, config: LeanConfig, row: Family) -> nn.Module | None:
    """gpt-oss's router (with a bias) and experts as transformers holds them: gate and up
    interleaved in one [experts, hidden, 2 × intermediate] tensor, down as [experts, intermediate,
    hidden], each with a bias; read as stored, or dequantized from MXFP4 blocks (mxfp4.py). None
    for another family's layer."""
    router = f"{prefix}.mlp.router.weight"
    if row.experts != "stacked" or router not in tensors:
        return None
    routing, experts, moe = nn.Module(), nn.Module(), nn.Module()
    routing.weight = nn.Parameter(tensors.get(router), requires_grad=False)
    routing.bias = nn.Parameter(tensors.get(f"{prefix}.mlp.router.bias"), requires_grad=False)
    routing.top_k = config.num_experts_per_tok
    experts.is_transposed = True  # [experts, in, out], as the quantizer and family read it
    block = f"{prefix}.mlp.experts"
    hidden = config.hidden_size
    for name, hidden_side in (("gate_up_proj", 1), ("down_proj", 2)):
        tensor = f"{block}.{name}"
        weight = _mxfp4_experts(tensors, tensor) if f"{tensor}_blocks" in tensors else tensors.get(tensor)
        if weight.dim() != 3 or weight.shape[hidden_side] != hidden:
            raise DamagedCheckpoint(f"a checkpoint whose tensor {tensor} has the shape {list(weight.shape)}")
        setattr(experts, name, nn.Parameter(weight, requires_grad=False))
        setattr(experts, f"{name}_bias", nn.Parameter(tensors.get(f"{tensor}_bias"), requires_grad=False))
    _fits_the_stream(router, routing.weight, hidden)
    moe.router, moe.experts = routing, experts
    return moe


def _mxfp4_experts(tensors: TensorSource, name: str) -> torch.Tensor:
    """`name`'s experts from its `_blocks` and `_scales`, dequantized into the model's dtype. Blocks
    and scales that do not match are refused naming them, before the layer's tensor is made."""
    from llmcli.models.mxfp4 import stacked_experts

    blocks, scales = tensors.get(f"{name}_blocks", torch.uint8), tensors.get(f"{name}_scales", torch.uint8)
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(
            f"the checkpoint's MXFP4 tensors {name}_blocks {list(blocks.shape)} and "
            f"{name}_scales {list(scales.shape)} do not match (16 bytes of blocks to a scale)",
            "the checkpoint is damaged: download it again",
        )
    return stacked_experts(blocks, scales, tensors.dtype)

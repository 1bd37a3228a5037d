"""A GGUF file read as it is: its tensors straight from the file, nothing converted on disk.

For the architectures the native engine runs (llama.cpp's `llama`, which Mistral's files use
too, `qwen2`, `qwen3`, and Qwen3.5's `qwen35`, `qwen35moe` and `qwen3next`, whose DeltaNet and
expert tensors gguf_deltanet.py puts back in transformers' layout), a GGUF file's small parts are
written once beside its fingerprint in llmcli's cache — config.json (from the file's metadata),
the tokenizer and chat template (transformers' own GGUF tokenizer conversion, once), and a note
of where the file is — and its weights are read from the file itself at every load:

- F32, F16 and BF16 tensors as they are;
- Q4_0, Q4_1 and Q4_K tensors as int4 codes on groups of 32, the file's own blocks
  (gguf_int4.py: bit-equal to gguf's dequantization);
- every other type through gguf's own dequantization, to the model's width, then llmcli's int8
  (measured: torch's int8 kernel runs 2.3–2.9× faster than an exact block kernel in numba here;
  docs/benchmarks.md);
- on a CPU, a quantized embedding stays in its blocks (gguf_embedding.py), and an output head
  (or the embedding tied to it) of a 4-bit type takes its own codes.

Before this, every GGUF file was converted by transformers into an fp16 copy in the cache
(about 30 s and 2-4× the file's size, measured on the demo); other architectures still are
(gguf.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmcli.atomic import folder_written_atomically, write_text_atomically
from llmcli.errors import ModelLoadError
from llmcli.models import gguf_deltanet, gguf_gemma4
from llmcli.models.families import by_gguf
from llmcli.models.gguf_cache import (
    NAME_FILE,
    SOURCE_FILE,
    fingerprint,
    is_direct,
    kind_of_types,
    recorded_source,
    write_weight_kind,
)
from llmcli.models.gguf_int4 import unpermute_rows
from llmcli.models.gguf_table import GGUFTable, TableEntry, read_table
from llmcli.models.headers import TensorHeader

if TYPE_CHECKING:
    import torch

# How config_of reads a file's metadata: a folder whose config.json an older reading wrote gets it
# written again (2: YaRN's factor and pretraining length read; 3: its sampling defaults and
# special token ids checked, check_metadata; 4: Qwen3.5's multimodal RoPE sections read).
CONFIG_VERSION, CONFIG_VERSION_FILE = 4, ".llmcli-config-version"
EXACT_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# The block types gguf's own dequantization reads (gguf 0.19; tests hold it to this list):
# every type llama.cpp's quantizer writes. The others GGUF defines (integer tensors, F64, and
# the Q8_1/Q8_K types llama.cpp keeps for activations) are refused, in one line naming them.
DEQUANTIZED_TYPES = (
    "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)  # fmt: skip
READABLE_TYPES = (*sorted(FLOAT_TYPES), *sorted(EXACT_INT4_TYPES), *DEQUANTIZED_TYPES)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1-style scaling, stored as the divisors of inv_freq
_FILE_HINT = (
    "the file is damaged or was written wrong: download it again, or check it with llama.cpp's gguf-dump"
)


def hf_name(gguf_name: str, architecture: str | None = None) -> str | None:
    """transformers' name for a GGUF tensor of a file of `architecture` (blk.3.attn_q.weight →
    model.layers.3.self_attn.q_proj.weight); None for one its layout has no place for."""
    if architecture == "gemma4":
        return gguf_gemma4.hf_name(gguf_name)
    if gguf_name.startswith("blk.") and _is_hybrid(architecture):
        block, _, rest = gguf_name.removeprefix("blk.").partition(".")
        within = gguf_deltanet.BLOCK_NAMES.get(rest)
        return f"model.layers.{block}.{within}" if block.isdigit() and within else None
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    return None


def _is_hybrid(architecture: str | None) -> bool:
    """A file of Gated DeltaNet layers beside attention ones (gguf_deltanet.py): Qwen3.5's."""
    row = by_gguf(architecture) if architecture is not None else None
    return row is not None and row.layer_types == "linear"


def mtp_blocks(table: GGUFTable) -> int:
    """How many blocks at the end of a hybrid file hold its multi-token-prediction head
    (llama.cpp's converter writes Qwen3.5's MTP layers as `nextn` blocks past the model's own,
    counted in its block_count): llmcli's engine does not read them yet, and runs the rest."""
    if not _is_hybrid(table.architecture):
        return 0
    count = table.metadata.get(f"{table.architecture}.nextn_predict_layers", 0)
    return count if isinstance(count, int) and count > 0 else 0


def in_mtp_block(table: GGUFTable, name: str) -> bool:
    """Whether the tensor `name` (the file's) is one of an MTP block's (mtp_blocks)."""
    mtp, total = mtp_blocks(table), table.metadata.get(f"{table.architecture}.block_count")
    block = name.split(".")[1] if name.startswith("blk.") and name.count(".") > 1 else ""
    return mtp > 0 and block.isdigit() and isinstance(total, int) and total - mtp <= int(block) < total


def deltanet_sizes(table: GGUFTable) -> gguf_deltanet.DeltaNetSizes | None:
    """The DeltaNet's sizes a hybrid file's metadata gives (None for another file); one whose
    sizes contradict each other is refused, naming the key."""
    if not _is_hybrid(table.architecture):
        return None
    tiled = not by_gguf(table.architecture).grouped_deltanet_projections  # Qwen3-Next's are grouped
    key = lambda name: table.metadata.get(f"{table.architecture}.{name}")  # noqa: E731
    sizes, problem = gguf_deltanet.sizes_of(key, tiled)
    if sizes is None:
        raise ModelLoadError(f"{table.path}: {problem}", _FILE_HINT)
    return sizes


def reads_directly(table: GGUFTable) -> bool:
    """Whether the file is read in place: an architecture the lean model builds, every tensor
    one it has a place for (a Mixtral file is `llama` with experts: transformers' path takes
    it, as before), and of a type read here (one that is not is refused now, naming it)."""
    if by_gguf(table.architecture) is None:
        return False
    unplaced = (
        name
        for name in table.tensors
        if hf_name(name, table.architecture) is None
        and name != ROPE_FACTORS
        and not in_mtp_block(table, name)
    )
    if next(unplaced, None) is not None:
        return False
    quantized = next((e for e in table.tensors.values() if e.type_name not in FLOAT_TYPES), None)
    if table.architecture == "gemma4" and quantized is not None:
        # The native Gemma 4 engine takes no embedding kept in its blocks nor int4 codes yet, and
        # transformers' converter fails on the per-layer widths of these files: refused by name.
        raise ModelLoadError(
            f"{table.path}: a quantized Gemma 4 file (tensor {quantized.name} is {quantized.type_name}), "
            "which llmcli does not read yet",
            "use an F32, F16 or BF16 file of the model",
        )
    for entry in table.tensors.values():
        if entry.type_name not in READABLE_TYPES:
            raise ModelLoadError(
                f"{table.path}: tensor {entry.name} is of type {entry.type_name}, which llmcli cannot read",
                f"llmcli reads {', '.join(READABLE_TYPES)}",
            )
    return True


def config_of(table: GGUFTable) -> dict[str, Any]:
    """config.json for the file, from its metadata: the fields the lean model reads."""
    arch, meta = table.architecture, table.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def count(name: str, default: Any = None) -> int:
        """A whole-number setting: one missing, or of another kind (text), is named in one line
        rather than failing inside int() as an unexpected error."""
        value = key(name, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            what = "lacks" if value is None else f"gives {value!r} for"
            raise ModelLoadError(
                f"{table.path}: its metadata {what} {arch}.{name}, a whole number", _FILE_HINT
            )
        return value

    if arch == "gemma4":
        return _gemma4_config(table, key, count)
    row = by_gguf(arch)
    sparse = row is not None and row.shared_expert  # a MoE file: its dense width may be left out
    dense_width = key("expert_feed_forward_length") if sparse else None
    heads = count("attention.head_count")
    hidden = count("embedding_length")
    if heads <= 0 or hidden <= 0:
        raise ModelLoadError(
            f"{table.path}: its metadata gives {heads} attention heads for a width of {hidden}", _FILE_HINT
        )
    embed = table.tensors.get("token_embd.weight")
    vocab = int(key("vocab_size") or (embed.shape[0] if embed else meta.get("tokenizer.ggml.tokens", 0)))
    config: dict[str, Any] = {
        "architectures": [by_gguf(arch).architecture],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length", dense_width),
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": count("attention.key_length", hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": count("context_length", 2048),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in table.tensors,
        "attention_bias": "blk.0.attn_q.bias" in table.tensors,
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if config["rope_theta"] <= 0:
        raise ModelLoadError(
            f"{table.path}: its metadata gives RoPE the base {config['rope_theta']}", _FILE_HINT
        )
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling == "yarn":  # Qwen's long-context files: the lean model computes it as transformers does
        config["rope_scaling"] = _yarn_of(table, key)
    elif scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": str(scaling)}  # the lean model refuses it by name
    sizes = deltanet_sizes(table)
    if sizes is not None:
        config["num_hidden_layers"] -= mtp_blocks(table)
        problem = gguf_deltanet.layout_problem(key, config["head_dim"], config["num_hidden_layers"])
        if problem is not None:
            raise ModelLoadError(f"{table.path}: {problem}", _FILE_HINT)
        config |= gguf_deltanet.config_fields(key, sizes, config["head_dim"], config["num_hidden_layers"])
        config["model_type"] = gguf_deltanet.MODEL_TYPES[arch]
        if sparse:
            experts, problem = gguf_deltanet.expert_fields(key, row.grouped_deltanet_projections)
            if experts is None:
                raise ModelLoadError(f"{table.path}: {problem}", _FILE_HINT)
            config |= experts
        rope = {"rope_type": "default", "rope_theta": config["rope_theta"]} | config.pop("rope_scaling", {})
        config["rope_parameters"] = rope | {"partial_rotary_factor": config.pop("partial_rotary_factor")}
        sections = key("rope.dimension_sections", None)
        if isinstance(sections, list) and len(sections) >= 3 and all(type(n) is int for n in sections):
            # Qwen3.5's multimodal RoPE (an image's rows over its grid, with an mmproj file);
            # text alone is one position on every axis.
            config["rope_parameters"] |= {"mrope_section": sections[:3], "mrope_interleaved": True}
    return config


def _gemma4_config(table: GGUFTable, key: Callable[..., Any], count: Callable[..., int]) -> dict[str, Any]:
    """config.json for a Gemma 4 file: its layout per layer (gguf_gemma4.py) as Gemma4TextConfig's."""
    factors = table.tensors.get(ROPE_FACTORS)
    values = None if factors is None else _values(read_table_bytes(table, factors), factors).tolist()
    fields, problem = gguf_gemma4.config_fields(key, table.tensors, values)
    if fields is None:
        raise ModelLoadError(f"{table.path}: {problem}", _FILE_HINT)
    embed, per_layer = (
        table.tensors.get("token_embd.weight"),
        table.tensors.get("per_layer_token_embd.weight"),
    )
    meta = table.metadata
    return {
        "architectures": [by_gguf(table.architecture).architecture],
        "model_type": "gemma4_text",
        "hidden_size": count("embedding_length"),
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": count("attention.head_count"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": count("context_length", 131_072),
        "vocab_size": embed.shape[0] if embed else len(meta.get("tokenizer.ggml.tokens", [])),
        "vocab_size_per_layer_input": per_layer.shape[0] if per_layer else 0,
        "tie_word_embeddings": "output.weight" not in table.tensors,
        "attention_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        **fields,
    }


def read_table_bytes(table: GGUFTable, entry: TableEntry) -> np.ndarray:
    """A small tensor's bytes, read from its file (no mapping kept)."""
    return np.fromfile(table.path, dtype=np.uint8, count=entry.nbytes, offset=entry.start)


# YaRN's settings a GGUF file may hold beyond its factor and pretraining length, in transformers'
# names; llama.cpp's attention and extrapolation multipliers have none there, and are refused.
_YARN_KEYS = {"rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow"}
_YARN_UNREAD = (
    "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_log_multiplier",
)


def _yarn_of(table: GGUFTable, key: Any) -> dict[str, Any]:
    """rope_scaling for a file whose metadata says YaRN: without its factor and pretraining length
    it would run as plain RoPE (a factor of 1), every position's frequencies other than llama.cpp's."""
    factor, original = key("rope.scaling.factor"), key("rope.scaling.original_context_length")
    unread = [name for name in _YARN_UNREAD if key(name) is not None]
    if not factor or not original or unread:
        what = (
            f"YaRN with {', '.join(unread)}"
            if unread
            else "YaRN without its factor and original context length"
        )
        raise ModelLoadError(
            f"{table.path}: its RoPE is {what}, which llmcli does not read",
            "llmcli computes YaRN from a factor and a pretraining length, as transformers does",
        )
    rope = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for name, setting in _YARN_KEYS.items():
        if key(name) is not None:
            rope[setting] = float(key(name))
    return rope


def check_shapes(table: GGUFTable) -> None:
    """Every tensor the shape its file's metadata implies, and every one it implies there, as
    llama.cpp checks them before reading a weight: a matrix of other rows (a damaged or wrongly
    written file) would otherwise load and fail inside the first pass, or run if its rows still
    fit; a missing norm would run as another model. ModelLoadError naming the tensor."""
    config = config_of(table)
    blocks = config["num_hidden_layers"]
    if table.architecture == "gemma4":  # its layers differ: their shapes and tensors, layer by layer
        _check_gemma4_shapes(table, config)
        _require(table, gguf_gemma4.required(config), blocks)
        return
    within, top = _expected_shapes(config)
    sizes = deltanet_sizes(table)
    if sizes is not None:
        within = gguf_deltanet.expected_shapes(config, sizes)
    for entry in table.tensors.values():
        block, _, rest = entry.name.removeprefix("blk.").partition(".")
        in_block = entry.name.startswith("blk.") and block.isdigit()
        if in_block and int(block) >= blocks:
            if in_mtp_block(table, entry.name):
                continue  # an MTP head's, not read (mtp_blocks)
            raise _wrongly_shaped(table, f"tensor {entry.name} is past its {blocks} blocks")
        expected = within.get(rest) if in_block else top.get(entry.name)
        if expected is not None and not gguf_deltanet.fits(rest, entry.shape, expected):
            settings = gguf_deltanet.IMPLIED_BY.get(rest) if sizes is not None and in_block else None
            raise _wrongly_shaped(
                table,
                f"tensor {entry.name} has the shape {list(entry.shape)}, where its metadata "
                f"implies {list(expected)}" + (f" (by its {settings})" if settings else ""),
            )
    names = ["token_embd.weight", "output_norm.weight"]
    _require(
        table,
        names + [f"blk.{i}.{part}" for i in range(blocks) for part in _required(table, config, i)],
        blocks,
    )


def _check_gemma4_shapes(table: GGUFTable, config: dict[str, Any]) -> None:
    """A Gemma 4 file's block tensors the shapes its metadata implies, layer by layer."""
    shapes = [
        _expected_shapes(layer)[0] | gguf_gemma4.own_shapes(config)
        for layer in gguf_gemma4.layer_settings(config)
    ]
    for entry in table.tensors.values():
        block, _, rest = entry.name.removeprefix("blk.").partition(".")
        if not (entry.name.startswith("blk.") and block.isdigit()):
            continue
        if int(block) >= len(shapes):
            raise _wrongly_shaped(table, f"tensor {entry.name} is past its {len(shapes)} blocks")
        expected = shapes[int(block)].get(rest)
        if expected is not None and tuple(entry.shape) != expected:
            raise _wrongly_shaped(
                table,
                f"tensor {entry.name} has the shape {list(entry.shape)}, "
                f"where its metadata implies {list(expected)}",
            )


def _require(table: GGUFTable, names: list[str], blocks: int) -> None:
    for name in names:
        if name not in table.tensors:
            raise _wrongly_shaped(table, f"tensor {name} is missing (its metadata names {blocks} blocks)")


def _required(table: GGUFTable, config: dict[str, Any], block: int) -> list[str]:
    """The tensors block `block` must hold, by their name within it, as llama.cpp's loader
    requires them: a Llama block's and what its family adds, or a hybrid's by its layer kind."""
    row = by_gguf(table.architecture)
    if _is_hybrid(table.architecture):
        kind = config["layer_types"][block]
        return sorted(gguf_deltanet.required(kind, row.shared_expert, row.grouped_deltanet_projections))
    return sorted(_REQUIRED_IN_A_BLOCK | (row.gguf_required if row is not None else frozenset()))


def _expected_shapes(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The shapes `config` implies, in torch's order ([out, in] for a matrix): of a block's
    tensors (by their name within the block), and of the others."""
    hidden, inner, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    queries, keys = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    within = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (queries, hidden),
        "attn_k.weight": (keys, hidden),
        "attn_v.weight": (keys, hidden),
        "attn_output.weight": (hidden, queries),
        "attn_q.bias": (queries,),
        "attn_k.bias": (keys,),
        "attn_v.bias": (keys,),
        "attn_output.bias": (hidden,),
        "attn_q_norm.weight": (head,),
        "attn_k_norm.weight": (head,),
        "ffn_gate.weight": (inner, hidden),
        "ffn_up.weight": (inner, hidden),
        "ffn_down.weight": (hidden, inner),
    }
    top = {
        "token_embd.weight": (config["vocab_size"], hidden),
        "output.weight": (config["vocab_size"], hidden),
        "output_norm.weight": (hidden,),
        ROPE_FACTORS: (head // 2,),
    }
    return within, top


_REQUIRED_IN_A_BLOCK = frozenset({
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
})  # fmt: skip


def _wrongly_shaped(table: GGUFTable, what: str) -> ModelLoadError:
    return ModelLoadError(f"{table.path} does not match its own metadata: {what}", _FILE_HINT)


# The sampling values a file's author wrote into its metadata (llama.cpp reads them as its
# defaults), in generation_config.json's names, which llmcli's sampling defaults read.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


# The special tokens a reply starts and ends with: an id past the vocabulary would be dropped
# from every prompt, or never end a reply.
_SPECIAL_TOKEN_KEYS = {"BOS": "tokenizer.ggml.bos_token_id", "EOS": "tokenizer.ggml.eos_token_id"}
_METADATA_HINT = (
    "its metadata is damaged: download the file again, or fix the key with gguf's gguf_set_metadata"
)


def check_metadata(table: GGUFTable) -> None:
    """The file's sampling defaults within the bounds the same settings have in a config file,
    and its BOS and EOS ids within its vocabulary: ModelLoadError naming the file and the key,
    at its first read rather than as a crash in sampling or an empty reply after the load."""
    from llmcli.config.settings import model_default_problem

    meta = table.metadata
    for key, name in _SAMPLING_KEYS.items():
        value = meta.get(key)
        problem = model_default_problem(name, value) if value is not None else None
        if problem is not None:
            raise ModelLoadError(f"{table.path}: its {key} {problem}", _METADATA_HINT)
    tokens = meta.get("tokenizer.ggml.tokens")  # read as its count
    vocabulary = len(tokens) if isinstance(tokens, list) else tokens
    if not isinstance(vocabulary, int):
        return  # no vocabulary: the tokenizer's reading says so
    for which, key in _SPECIAL_TOKEN_KEYS.items():
        value = meta.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < vocabulary):
            raise ModelLoadError(
                f"{table.path}: its {which} token id ({key} = {value!r}) is outside its vocabulary "
                f"of {vocabulary} tokens",
                _METADATA_HINT,
            )


def generation_config_of(table: GGUFTable) -> dict[str, Any]:
    """generation_config.json for the file: its end-of-sequence token and sampling defaults
    (checked by check_metadata)."""
    meta = table.metadata
    generation: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        value = meta.get(key)
        if value is not None:
            # Stored as float32: 0.9 comes back as 0.8999999761581421, written as the 0.9 meant.
            generation[name] = float(f"{value:.7g}") if isinstance(value, float) else value
    if meta.get("tokenizer.ggml.eos_token_id") is not None:
        generation["eos_token_id"] = meta["tokenizer.ggml.eos_token_id"]
    return generation


def direct_folder(gguf_file: Path, target: Path, table: GGUFTable) -> Path:
    """`target` holding the file's small parts, written now if they are not there yet (a few
    seconds, once: the tokenizer). The caller holds the conversion lock of `target`."""
    if (target / SOURCE_FILE).is_file():
        if recorded_source(target) != gguf_file:  # the same content, moved or copied: follow it
            write_text_atomically(target / SOURCE_FILE, f"{gguf_file}\n")
        refresh_config(target, table)
        return target
    with folder_written_atomically(target) as staging:
        (staging / "config.json").write_text(json.dumps(config_of(table), indent=2) + "\n")
        (staging / CONFIG_VERSION_FILE).write_text(f"{CONFIG_VERSION}\n")
        generation = generation_config_of(table)
        if generation:
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _save_tokenizer(gguf_file, table, staging)
        write_weight_kind(staging, _stored_kind(table))
        (staging / SOURCE_FILE).write_text(f"{gguf_file}\n")
        kept_name = target / NAME_FILE  # an older llmcli's converted copy, imported under a name
        if kept_name.is_file():
            shutil.copy(kept_name, staging / NAME_FILE)
    return target


def config_is_current(folder: Path) -> bool:
    """Whether the folder's config.json was written by config_of as it reads metadata now."""
    with contextlib.suppress(OSError):
        return (folder / CONFIG_VERSION_FILE).read_text().strip() == str(CONFIG_VERSION)
    return False


def refresh_config(folder: Path, table: GGUFTable) -> None:
    """config.json as this llmcli writes it from the file's metadata: one an older llmcli wrote
    is written again where it reads the metadata otherwise (before YaRN's factor was read, a YaRN
    file's config said YaRN without it, and ran as plain RoPE)."""
    if config_is_current(folder):
        return
    config = config_of(table)
    if _stored_config(folder) != config:
        write_text_atomically(folder / "config.json", json.dumps(config, indent=2) + "\n")
    write_text_atomically(folder / CONFIG_VERSION_FILE, f"{CONFIG_VERSION}\n")


def bring_up_to_date(folder: Path) -> None:
    """A folder read before, by the file's path or the name `models import --name` gave it: if an
    older llmcli wrote its config, the file is checked (check_shapes) and the config written again."""
    if is_direct(folder) and not config_is_current(folder):
        table = read_table(source_of(folder))
        check_shapes(table)
        check_metadata(table)
        refresh_config(folder, table)


def _stored_config(folder: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((folder / "config.json").read_text())
    return None


def _save_tokenizer(gguf_file: Path, table: GGUFTable, folder: Path) -> None:
    """The file's tokenizer (its vocabulary, merges, pre-tokenizer and special tokens as llama.cpp
    recorded them), saved once: built by llmcli for byte-level BPE files, in a fraction of a
    second; through transformers' conversion for the others (sentencepiece, unigram), seconds."""
    from llmcli.models import gguf_tokenizer

    if gguf_tokenizer.builds(table):
        gguf_tokenizer.write_tokenizer(table, folder)
        return
    from transformers import AutoTokenizer

    from llmcli.models.libraries import quiet_libraries
    from llmcli.models.tokenizer_capture import write_plain

    quiet_libraries()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, KeyError, IndexError, OSError, RuntimeError) as error:
        raise ModelLoadError(f"cannot read the tokenizer of {gguf_file.name}: {error}") from error
    write_plain(tokenizer, folder)  # as the lean tokenizer reads it where it answers alike


def _stored_kind(table: GGUFTable) -> str:
    """ "int4 Q5_0": the kind --quant auto loads the file as, then its main type. A file with any
    4-bit layer read exactly loads as int4, whatever most of its layers are: its other quantized
    layers are int8 either way (GGUFCodes.wider), and the 4-bit ones keep their own codes. (The
    demo made Q4_K_M by llama.cpp is mostly Q5_0, its fallback for width 576.)"""
    layers = [
        (entry.type_name, entry.shape)
        for entry in table.tensors.values()
        if entry.name.startswith("blk.") and len(entry.shape) == 2
    ]
    stored = kind_of_types(layers)
    if any(type_name in EXACT_INT4_TYPES for type_name, _ in layers):
        return "int4 " + stored.split()[-1]
    return stored


def source_of(folder: Path) -> Path:
    """The GGUF file a directly read folder stands for, checked to be there still, with the
    content the folder was written for (its name ends with the content's fingerprint): a file
    rewritten in place since must not be read with another file's config and tokenizer."""
    source = recorded_source(folder)
    if source is None or not source.is_file():
        raise ModelLoadError(
            f"the GGUF file behind {folder.name} is gone ({source})",
            "pass the .gguf file with -m again, or `llmcli models import` it where it is now",
        )
    if fingerprint(source) != folder.name.rsplit("-", 1)[-1]:
        raise ModelLoadError(
            f"the GGUF file behind {folder.name} has changed since it was read ({source})",
            "pass the .gguf file with -m, or `llmcli models import` it again",
        )
    return source


def shapes_of_table(table: GGUFTable) -> dict[str, TensorHeader]:
    """transformers' name → the file's tensors' shapes, element sizes (2 for blocks: the 16-bit
    width they are estimated against) and types (Checkpoint.shapes); those it holds in parts
    (joined_parts) as the model holds them, joined, each weight counted once."""
    widths = {"F32": 4, "F16": 2, "BF16": 2}
    by_name = _by_hf_name(table)
    shapes = {
        name: TensorHeader(
            list(gguf_deltanet.hf_shape(name, entry.shape)),
            widths.get(entry.type_name, 2),
            entry.type_name,
            entry.nbytes,
        )
        for name, entry in by_name.items()
    }
    for name, part_names in joined_parts(table, by_name).items():
        parts = [by_name[part] for part in part_names]
        shape = gguf_deltanet.joined_shape(name, [part.shape for part in parts])
        first = parts[0]
        shapes[name] = TensorHeader(
            list(shape), widths.get(first.type_name, 2), first.type_name, sum(part.nbytes for part in parts)
        )
        for part in part_names:
            del shapes[part]
    return shapes


def _by_hf_name(table: GGUFTable) -> dict[str, TableEntry]:
    """The file's tensors the model reads, by transformers' name (an MTP block's left out)."""
    return {
        hf: entry
        for entry in table.tensors.values()
        if (hf := hf_name(entry.name, table.architecture)) and not in_mtp_block(table, entry.name)
    }


def joined_parts(table: GGUFTable, by_name: dict[str, TableEntry]) -> dict[str, tuple[str, ...]]:
    """transformers' tensors a hybrid file holds in parts (gguf_deltanet.JOINED; Qwen3-Next's
    in_proj_qkvz too), by their name, → the parts' names, in order; where every part is there."""
    row = by_gguf(table.architecture)
    if row is None or not _is_hybrid(table.architecture):
        return {}
    wanted = gguf_deltanet.JOINED | (gguf_deltanet.GROUPED_JOINED if row.grouped_deltanet_projections else {})
    found: dict[str, tuple[str, ...]] = {}
    for name in by_name:
        for target, parts in wanted.items():
            if name.endswith(f".{parts[0]}"):
                prefix = name.removesuffix(parts[0])
                if all(prefix + part in by_name for part in parts):
                    found[prefix + target] = tuple(prefix + part for part in parts)
    return found


_COPIED_BELOW = 1 << 20  # bytes
_PRIVATE_COPIES: ContextVar[bool] = ContextVar("llmcli_gguf_private_copies", default=False)


@contextlib.contextmanager
def private_copies() -> Iterator[None]:
    """The loads inside it keep nothing mapped to a GGUF file: every tensor is a copy read from
    it. For a process that lives on after its load (a server): a mapped page of a file truncated
    since kills the process with SIGBUS at its next use, and one overwritten in place changes what
    the model computes. A call that ends with its reply keeps the mapping (a quantized
    embedding's rows are read only where used; a float model's pages stay shared with the other
    processes that read the file)."""
    token = _PRIVATE_COPIES.set(True)
    try:
        yield
    finally:
        _PRIVATE_COPIES.reset(token)


class GGUFTensors:
    """The file's tensors by transformers' name, each read when asked for, in the lean model's
    dtype on its device (the same calls as lean_model.Tensors)."""

    # The config is llmcli's, written from the file's own tensors: what it implies is read where
    # present (a Llama file with q/k/v biases and none on its output, say, as llama.cpp runs it).
    implied_required = False

    def __init__(
        self,
        source: Path,
        dtype: torch.dtype,
        device: torch.device,
        heads: tuple[int, int],
        table: GGUFTable | None = None,
    ) -> None:
        """`source`: the GGUF file, checked (source_of); `table`: its table, where read already."""
        self.dtype, self.device = dtype, device
        self.path = source
        self.table = table or read_table(source)  # checked when the folder was resolved (check_shapes)
        self._by_name = _by_hf_name(self.table)
        self._joined = joined_parts(self.table, self._by_name)  # read as their parts joined
        self._sizes = deltanet_sizes(self.table)  # a hybrid's: its tensors stored otherwise are restored
        # Copy-on-write: torch takes a writable array; nothing is ever written through it.
        # None: every tensor is a copy (private_copies).
        self._file = None if _PRIVATE_COPIES.get() else np.memmap(self.path, dtype=np.uint8, mode="c")
        row = by_gguf(self.table.architecture)
        self._permuted = row is not None and row.gguf_permuted
        self._heads = {"q_proj": heads[0], "k_proj": heads[1]}

    def __contains__(self, name: str) -> bool:
        return name in self._by_name or name in self._joined

    def entry(self, name: str) -> TableEntry:
        from llmcli.models.lean_config import DamagedCheckpoint

        entry = self._by_name.get(name)
        if entry is None:
            raise DamagedCheckpoint(f"a GGUF file without the tensor for {name}")
        return entry

    def raw(self, entry: TableEntry) -> np.ndarray:
        """The tensor's bytes: a view of the file's mapping, or a copy under private_copies."""
        if self._file is None:
            return self.read(entry).reshape(-1)
        return self._file[entry.start : entry.start + entry.nbytes]

    def read(self, entry: TableEntry, rows: slice = slice(None)) -> np.ndarray:
        """A copy of the bytes of some of the matrix's rows (each a whole number of blocks), read
        from the file rather than through the mapping: what is read only to be turned into codes
        would otherwise stay mapped into the process (the demo's 4-bit layers and Q8_0 head:
        about 100 MB of its peak, measured)."""
        start, stop, _ = rows.indices(entry.shape[0])
        row_bytes = entry.nbytes // entry.shape[0]
        count = max(0, stop - start) * row_bytes
        data = np.fromfile(self.path, dtype=np.uint8, count=count, offset=entry.start + start * row_bytes)
        if data.size != count:
            from llmcli.models.lean_config import DamagedCheckpoint

            raise DamagedCheckpoint(f"a GGUF file cut inside the tensor {entry.name}")
        return data.reshape(max(0, stop - start), row_bytes)

    def rows_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp interleaved in this tensor, if it did."""
        if not self._permuted:
            return None
        projection = name.rsplit(".", 2)[-2]
        return self._heads.get(projection)

    def _stored(self, entry: TableEntry) -> torch.Tensor:
        """The tensor's values as stored (float types as they are, blocks dequantized)."""
        # A small tensor (a norm) read through the mapping maps its neighbours' pages too: the
        # demo's 61 norms brought 38 MB of the file into the process. Those are copied instead.
        raw = self.read(entry).reshape(-1) if entry.nbytes < _COPIED_BELOW else self.raw(entry)
        return _values(raw, entry)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self._joined:
            parts = [self._stored(self._by_name[part]) for part in self._joined[name]]
            tensor = gguf_deltanet.joined(name, parts, self._sizes)
            return tensor.to(device=self.device, dtype=dtype or self.dtype)
        tensor = self._stored(self.entry(name))
        heads = self.rows_heads(name)
        if heads is not None:
            tensor = unpermute_rows(tensor, heads).contiguous()
        if self._sizes is not None:
            tensor = gguf_deltanet.restore(name, tensor, self._sizes)
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None

    def stand_in(self, name: str) -> torch.Tensor:
        import torch

        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.entry(name).shape)

    def embedding(self, name: str, packed: bool) -> torch.nn.Module:
        """The embedding module: `packed` (a quantized model on a CPU), a quantized table stays
        in its blocks (gguf_embedding.py); otherwise, and for a float table, a dense one."""
        import torch

        entry = self.entry(name)
        if not packed or entry.type_name in FLOAT_TYPES or self.device.type != "cpu":
            return torch.nn.Embedding.from_pretrained(self.get(name), freeze=True)
        from llmcli.models.gguf_embedding import BlockEmbedding

        blocks = torch.from_numpy(self.raw(entry)).view(entry.shape[0], -1)
        return BlockEmbedding(blocks, entry.type_name, entry.shape[1], self.dtype)

    def rope_factors(self) -> torch.Tensor | None:
        """Llama 3.1's scaling; Gemma 4's rope_freqs is its proportional RoPE, read into its config."""
        entry = None if self.table.architecture == "gemma4" else self.table.tensors.get(ROPE_FACTORS)
        return None if entry is None else _values(self.raw(entry), entry).float()

    def linears_of(self, types: frozenset[str], inverted: bool = False) -> frozenset[str]:
        """The matrices (by module name) stored in one of `types` (in none of them: `inverted`),
        as transformers holds them: one whose rows the file holds in another order (a hybrid's
        regrouped value heads) is read through `get`, never as the file's blocks."""
        return frozenset(
            name.removesuffix(".weight")
            for name, entry in self._by_name.items()
            if name.endswith(".weight")
            and len(entry.shape) == 2
            and (entry.type_name in types) != inverted
            and (self._sizes is None or not gguf_deltanet.changed_on_store(name, self._sizes))
        )


class GGUFCodes:
    """The file's Q4_0, Q4_1 and Q4_K matrices as int4 codes (models/quantized.py's ExactCodes).
    `wider`: the matrices of other quantized types (5 to 8 bits, and the 2-, 3- and non-linear
    4-bit ones), which int8 holds, even in a model of int4 layers: int4 would requantize them
    onto a coarser grid than the file's."""

    group = 32

    def __init__(self, tensors: GGUFTensors) -> None:
        self._tensors = tensors
        embedding = {"model.embed_tokens"}
        self.names = tensors.linears_of(EXACT_INT4_TYPES) - embedding
        self.wider = tensors.linears_of(EXACT_INT4_TYPES | FLOAT_TYPES, inverted=True) - embedding
        # Every quantized matrix: what `int8` reads from the file's blocks.
        self.int8_names = tensors.linears_of(FLOAT_TYPES, inverted=True) - embedding
        head_type = self._head_entry().type_name  # the head, or the embedding tied to it
        if head_type in EXACT_INT4_TYPES:
            self.names |= {"lm_head"}
        if head_type not in FLOAT_TYPES:
            self.int8_names |= {"lm_head"}

    def _head_entry(self) -> TableEntry:
        name = "lm_head.weight" if "lm_head.weight" in self._tensors else "model.embed_tokens.weight"
        return self._tensors.entry(name)

    @classmethod
    def of(cls, folder: Path) -> GGUFCodes:
        import torch

        config = json.loads((folder / "config.json").read_text())
        heads = (
            config["num_attention_heads"],
            config.get("num_key_value_heads") or config["num_attention_heads"],
        )
        return cls(GGUFTensors(source_of(folder), torch.float32, torch.device("cpu"), heads))

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        from llmcli.models.gguf_int4 import codes_of

        weight = f"{name}.weight"
        entry = self._head_entry() if name == "lm_head" else self._tensors.entry(weight)
        out_features, in_features = entry.shape
        parts = codes_of(self._tensors.read(entry).reshape(-1), entry.type_name, out_features, in_features)
        heads = self._tensors.rows_heads(weight)
        if heads is not None:
            parts = tuple(unpermute_rows(part, heads) for part in parts)
        codes, scale, zero = (torch.from_numpy(np.ascontiguousarray(part)) for part in parts)
        return codes.to(torch.int32), scale, zero

    def block_type(self, name: str) -> str | None:
        """The GGUF type of the blocks a quantized layer is stored in (the head: its own, or the
        embedding's it is tied to), where they are read as the file holds them; else None."""
        if name not in self.int8_names:
            return None
        return (self._head_entry() if name == "lm_head" else self._tensors.entry(f"{name}.weight")).type_name

    def blocks(self, name: str) -> torch.Tensor:
        """The layer's blocks, uint8 [out_features, bytes per row], copied from the file (read,
        not mapped: the copy is all the process holds of them), its rows in transformers' order."""
        import torch

        weight = f"{name}.weight"
        entry = self._head_entry() if name == "lm_head" else self._tensors.entry(weight)
        blocks = self._tensors.read(entry)
        heads = self._tensors.rows_heads(weight)
        if heads is not None:
            blocks = np.ascontiguousarray(unpermute_rows(blocks, heads))
        return torch.from_numpy(blocks)

    def int8(self, name: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's per-channel int8 codes and scales, its blocks dequantized a slice of rows
        at a time (never a whole fp32 copy: the demo's Q8_0 head is 113 MB of it); None for a
        layer the file holds as floats."""
        import torch

        from llmcli.models.quantized import int8_codes

        if name not in self.int8_names:
            return None
        weight = f"{name}.weight"
        entry = self._head_entry() if name == "lm_head" else self._tensors.entry(weight)

        def rows(part: slice) -> torch.Tensor:
            blocks = self._tensors.read(entry, part)
            return _values(blocks.reshape(-1), entry, (len(blocks), entry.shape[1]))

        codes, scales = int8_codes(rows, entry.shape, torch.device("cpu"), scale_dtype)
        heads = self._tensors.rows_heads(weight)
        if heads is not None:
            codes, scales = (unpermute_rows(part, heads).contiguous() for part in (codes, scales))
        return codes, scales


def _values(raw: np.ndarray, entry: TableEntry, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor's values (or those of `shape`, rows of it): floats as stored (a view of the
    file where no copy is needed), Q8_0 by torch (five times gguf's speed, bit-equal), other types
    through gguf's own dequantization, in fp32."""
    import torch

    shape = shape or entry.shape
    floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if entry.type_name in floats:
        return torch.from_numpy(raw).view(floats[entry.type_name]).view(shape)
    if entry.type_name == "Q8_0":  # blocks of an fp16 scale and 32 int8 values
        blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, 34))
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        return (blocks[:, 2:].view(torch.int8).float() * scale).view(shape)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw, GGMLQuantizationType[entry.type_name])
    return torch.from_numpy(values.reshape(shape).astype("float32", copy=False))


def gguf_transformers_model(
    folder: Path,
    tensors_of: Callable[[tuple[int, int]], GGUFTensors],
    dtype: torch.dtype,
    device: torch.device,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """transformers' model of a file read in place, for what only transformers' path runs (beam
    search, `--engine transformers`): built from the config, its weights read as the lean
    model's are (`tensors_of`: the file's tensors, for its attention and KV heads). `kwargs`:
    from_pretrained's `attn_implementation` and `output_loading_info`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    # Read from the dict: Gemma 4's config refuses its KV heads as one number (they differ per layer).
    kv_heads = config.to_dict().get("num_key_value_heads")
    heads = (config.num_attention_heads, kv_heads or config.num_attention_heads)
    tensors = tensors_of(heads)
    if tensors.rope_factors() is not None:
        raise ModelLoadError(
            f"{tensors.path.name} scales RoPE by stored factors (as Llama 3.1 does), "
            "which only llmcli's own engine reads",
            "drop --engine transformers (beam search runs on transformers: use sampling or greedy)",
        )
    with torch.device(device):  # its random start values are all overwritten below
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=kwargs.get("attn_implementation")
        )
    wanted = model.state_dict()
    state = {name: tensors.get(name) for name in wanted if name in tensors}
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [
        name for name in result.missing_keys if not (config.tie_word_embeddings and name == "lm_head.weight")
    ]
    return model, {"missing_keys": missing, "mismatched_keys": []}

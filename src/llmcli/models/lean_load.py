"""The lean load path: a Llama-family folder read straight into the native engine's layout, its
tokenizer through `tokenizers`, without importing transformers (about two seconds of a one-shot
call's start on a CPU; docs/benchmarks.md).

It takes what it can read exactly as transformers' path would and nothing else: the
architectures lean_model.py builds, safetensors, the plain fast tokenizers lean_tokenizer.py
reads, llmcli's own int8/int4 or no quantization (gpt-oss's MXFP4 experts, dequantized on a CPU
as transformers' path dequantizes them there), one device, and an engine that may be the native
one. Anything else is a reason (`LeanUnsupported`): for an architecture the native
engine runs, the caller says it in one note and loads through transformers; for others
transformers' path is the only one, and nothing needs saying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmcli.errors import LlmcliError
from llmcli.models.families import family
from llmcli.models.lean_config import DamagedCheckpoint, LeanConfig, LeanUnsupported, TokenizerUnsupported

if TYPE_CHECKING:
    from pathlib import Path

    from llmcli.config.settings import LoadSettings
    from llmcli.models.lean_model import TensorSource
    from llmcli.models.lean_tokenizer import LeanTokenizer
    from llmcli.models.load import LoadedModel, LoadPlan
    from llmcli.models.quantized import ExactCodes
    from llmcli.models.resolve import ResolvedModel


@dataclass(frozen=True)
class LeanOutcome:
    loaded: LoadedModel | None  # None: load through transformers
    note: str | None = None  # why not, where there is something to say
    keep_tokenizer: bool = False  # the reason was the tokenizer: keep what transformers builds


def lean_load(resolved: ResolvedModel, settings: LoadSettings) -> LeanOutcome:
    """The model loaded the lean way, or a note saying why not (none when there is nothing to
    say: an architecture only transformers runs)."""
    try:
        architecture = _architecture(resolved)
    except LeanUnsupported:
        return LeanOutcome(None)
    if family(architecture) is None or _asked_for_transformers(settings):
        return LeanOutcome(None)
    try:
        return LeanOutcome(_load(resolved, settings))
    except DamagedCheckpoint:
        return LeanOutcome(None)
    except LeanUnsupported as why:
        note = f"loading through transformers (a slower start): the lean loader does not read {why}"
        return LeanOutcome(None, note, keep_tokenizer=isinstance(why, TokenizerUnsupported))


def _lean_tokenizer(folder: Path) -> LeanTokenizer:
    """The folder's tokenizer through `tokenizers`: as it stands, or as transformers built it on
    an earlier load and llmcli kept it (tokenizer_capture.py)."""
    from llmcli.models.lean_tokenizer import LeanTokenizer
    from llmcli.models.tokenizer_capture import captured

    try:
        return LeanTokenizer(folder)
    except TokenizerUnsupported:
        kept = captured(folder)
        if kept is None:
            raise
        return LeanTokenizer(kept)


def _asked_for_transformers(settings: LoadSettings) -> bool:
    """Settings only transformers' path serves, chosen by the user: nothing to note."""
    from llmcli.models.quant import bitsandbytes_only

    engine = settings.engine
    return engine == "transformers" or settings.offload or bitsandbytes_only(settings.quant, engine)


def _file_codes(resolved: ResolvedModel, plan: LoadPlan) -> ExactCodes | None:
    """A GGUF file's blocks as the quantizer reads them, where llmcli quantizes; read once a load
    (the layers they replace and the quantizer both ask)."""
    if resolved.source != "gguf" or plan.native_quant is None:
        return None
    return resolved.exact_codes()


def _read_by_quantizer(blocks: ExactCodes | None, plan: LoadPlan) -> frozenset[str]:
    """The linear layers the quantizer reads from a GGUF file's own blocks, whose float copies are
    therefore never made: the 4-bit ones taken as they are (int4 on the blocks' group, on a CPU,
    where every width takes int4), and those int8 holds, dequantized a slice at a time (every
    quantized layer under --quant int8; otherwise the wider ones and the head)."""
    from llmcli.models.gguf_direct import GGUFCodes

    if not isinstance(blocks, GGUFCodes):  # an older conversion: only its 4-bit codes, beside it
        take_codes = blocks is not None and plan.native_quant == "int4" and plan.device.type == "cpu"
        return frozenset(blocks.names) if take_codes and blocks.group == plan.group else frozenset()
    if plan.native_quant == "int8":
        return blocks.int8_names
    int8 = blocks.int8_names & (blocks.wider | {"lm_head"})
    if plan.device.type == "cpu" and blocks.group == plan.group:
        return blocks.names | int8
    return int8


def _tensors(resolved: ResolvedModel, config: LeanConfig, plan: LoadPlan) -> TensorSource:
    heads = (config.num_attention_heads, config.num_key_value_heads)
    return resolved.tensors(plan.dtype, plan.device, heads)


def _architecture(resolved: ResolvedModel) -> str:
    from llmcli.errors import ModelLoadError

    try:
        config = resolved.config
    except ModelLoadError:  # transformers' path says it, in its own words
        raise LeanUnsupported("its config.json") from None
    architectures = config.get("architectures") or [""]
    return str(architectures[0])


def _load(resolved: ResolvedModel, settings: LoadSettings) -> LoadedModel:
    import torch

    from llmcli.models.device import DTYPE_NAMES
    from llmcli.models.lean_model import build
    from llmcli.models.load import (
        LoadedModel,
        eos_ids,
        plan_load,
    )
    from llmcli.models.memory import kv_bytes_per_token, measured_weight_bytes
    from llmcli.models.quantized import quantize_model
    from llmcli.models.tensor_file import is_stand_in

    folder = resolved.path
    has_weights = resolved.read_in_place or any(folder.glob("*.safetensors"))
    if not has_weights or not resolved.has_tokenizer_json:
        raise LeanUnsupported("a folder without safetensors weights and a tokenizer.json")
    tokenizer = _lean_tokenizer(folder)  # before the weights: a refusal here costs nothing
    plan = plan_load(resolved, settings, quiet=False)
    notes = [plan.context_note] if plan.context_note else []
    stored = (plan.config.get("quantization_config") or {}).get("quant_method")
    row = family((plan.config.get("architectures") or [""])[0])
    if stored == "mxfp4" and row is not None and row.mxfp4_on_cpu and plan.device.type == "cpu":
        # As transformers' path does here (no MXFP4 kernel on a CPU), said as it says it.
        notes.append(
            f"MXFP4 experts dequantized to {DTYPE_NAMES.get(plan.dtype, plan.dtype)}: llmcli has no "
            "MXFP4 kernel on cpu, so they take 4-8x their size on disk in memory"
        )
    elif plan.config.get("quantization_config"):
        raise LeanUnsupported("a checkpoint that comes quantized")
    if plan.settings.quant != "none" and plan.native_quant is None:
        raise LeanUnsupported(f"--quant {plan.settings.quant} (bitsandbytes)")
    device = plan.device
    if device.type == "cuda" and device.index is None and torch.cuda.device_count() > 1:
        raise LeanUnsupported("a model for several GPUs")
    try:
        config = LeanConfig(plan.config)
        packed = plan.native_quant is not None and device.type == "cpu"
        exact = _file_codes(resolved, plan)
        model = build(_tensors(resolved, config, plan), config, _read_by_quantizer(exact, plan), packed)
    except (KeyError, AttributeError, TypeError, ValueError) as error:
        # A config field missing or of another shape: transformers' path reads it, or says why.
        raise LeanUnsupported(f"its config.json as written ({type(error).__name__}: {error})") from None
    except torch.OutOfMemoryError as error:
        from llmcli.models.load import out_of_memory_error

        raise out_of_memory_error(resolved, plan.settings, plan.config, device, plan.dtype) from error
    quant, quant_backend = "none", "none"
    if plan.native_quant is not None:
        tied = config.tie_word_embeddings
        quant = quantize_model(model, plan.native_quant, plan.group, exact)
        quant_backend = "native"
        if tied:
            from llmcli.models.gguf_embedding import share_tied_head

            share_tied_head(model)
    unread = next((name for name, p in model.named_parameters() if is_stand_in(p)), None)
    if unread is not None:  # a stand-in the quantizer did not replace: never run on it
        raise LlmcliError(f"{resolved.name}: {unread} was not loaded (a bug in llmcli's lean loader)")
    generation_config = resolved.generation_config
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        device=device,
        dtype=plan.dtype,
        generation_config=generation_config,
        eos_token_ids=eos_ids(
            generation_config.get("eos_token_id"), config.eos_token_id, tokenizer.eos_token_id
        ),
        context_length=plan.context,
        weight_bytes=measured_weight_bytes(model),
        quant=quant,
        quant_backend=quant_backend,
        kv_bytes_per_token=kv_bytes_per_token(plan.config, plan.dtype.itemsize),
        notes=tuple(notes),
        fast=plan.settings.fast,
        engine=plan.settings.engine,
        weights_file=resolved.gguf_file,
    )

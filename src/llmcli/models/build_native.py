"""The native builder: a checkpoint of a family the native engine runs, read straight into its
layout, its tokenizer through `tokenizers`, without importing transformers (about two seconds of
a one-shot call's start on a CPU; docs/benchmarks.md).

It takes what it can read exactly as transformers' path would and nothing else: the
architectures lean_model.py builds, safetensors or a GGUF file read in place, the plain fast
tokenizers lean_tokenizer.py reads, llmcli's own int8/int4 or no quantization (gpt-oss's MXFP4
experts, dequantized on a CPU as transformers' path dequantizes them there), one device, and an
engine that may be the native one. `choose` decides it from the plan, before any weight is read;
anything else is a reason (`LeanUnsupported`): for an architecture the native engine runs, the
pipeline says it in one note and builds through transformers; for others transformers' path is
the only one, and nothing needs saying. A reason found while building (a tensor the files lack,
an activation or RoPE the lean model does not compute) is the same fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmcli.errors import LlmcliError
from llmcli.models.built import Built
from llmcli.models.families import Family, family
from llmcli.models.lean_config import DamagedCheckpoint, LeanConfig, LeanUnsupported, TokenizerUnsupported

if TYPE_CHECKING:
    from pathlib import Path

    from llmcli.config.settings import LoadSettings
    from llmcli.models.checkpoint import Checkpoint
    from llmcli.models.lean_tokenizer import LeanTokenizer
    from llmcli.models.load_plan import LoadPlan
    from llmcli.models.quantized import ExactCodes


@dataclass(frozen=True)
class Refusal:
    """transformers builds: `note` says why where there is something to say (none for an
    architecture only transformers runs, or settings only it serves)."""

    note: str | None = None
    keep_tokenizer: bool = False  # the reason was the tokenizer: keep what transformers builds


@dataclass(frozen=True)
class NativeChoice:
    """The native builder builds, with what its checks read."""

    tokenizer: LeanTokenizer
    config: LeanConfig
    tied: bool  # the head is the embedding, as chosen (the quantizer unties it in the config)
    notes: tuple[str, ...] = ()  # said after the context's note


# The architectures whose MTP module the native engine runs as a drafter (engine/native/mtp.py):
# Qwen3.5 dense and MoE, as a text model or as the vision-language checkpoints Qwen publishes
# (their `mtp.*` lies beside `model.language_model.*`, under the same names), and Qwen3-Next,
# whose module is the same (vLLM's qwen3_next_mtp.py); an MoE one's layer has the body's MLP.
MTP_ARCHITECTURES = frozenset(
    {
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
    }
)


def require_mtp_head(checkpoint: Checkpoint, settings: LoadSettings, lean: bool) -> None:
    """--speculative mtp: refused in one line, from the tensors' names and the settings before
    any weight is read, where the checkpoint has no MTP module or the native builder would not
    build the model with it."""
    from llmcli.errors import UsageError

    if not any(name.startswith("mtp.") for name in checkpoint.shapes):
        raise UsageError(
            f"{checkpoint.name} has no MTP head (no mtp.* tensors) for --speculative mtp to draft with",
            "use --speculative lookup, or a draft model (--speculative draft --draft-model MODEL)",
        )
    if checkpoint.architecture not in MTP_ARCHITECTURES:
        raise UsageError(
            f"--speculative mtp: llmcli drafts with the MTP heads of {', '.join(sorted(MTP_ARCHITECTURES))} "
            f"only, and {checkpoint.name} is {checkpoint.architecture or 'of no architecture named'}",
            "use --speculative lookup",
        )
    if not lean or settings.engine == "transformers":  # auto runs these natively
        raise UsageError("--speculative mtp drafts on the native engine", "use --engine native or auto")


def note_for(why: LeanUnsupported) -> Refusal:
    """The note a reason makes, as the user reads it."""
    note = f"loading through transformers (a slower start): the lean loader does not read {why}"
    return Refusal(note, keep_tokenizer=isinstance(why, TokenizerUnsupported))


def choose(checkpoint: Checkpoint, plan: LoadPlan, settings: LoadSettings) -> NativeChoice | Refusal:
    """Whether the native builder builds this model, decided from the files' small parts and the
    plan, in the order of its checks: the first reason found is the one the note names."""
    row = family(checkpoint.architecture)
    if row is not None and row.layer_types == "linear":  # whichever engine runs it
        _check_linear_attention(checkpoint, plan, row)
    if row is None or _asked_for_transformers(settings):
        return Refusal()
    try:
        return _checked(checkpoint, plan)
    except DamagedCheckpoint:
        return Refusal()
    except LeanUnsupported as why:
        return note_for(why)


def _check_linear_attention(checkpoint: Checkpoint, plan: LoadPlan, row: Family) -> None:
    """A Gated DeltaNet layer's tensor missing, or of a shape its settings contradict, is refused
    in one line naming it (ModelLoadError), from the headers: transformers' path would start a
    layer without it from random values, or fail deep in a pass. A config this cannot read is left
    to the builders, which say what they make of it."""
    from llmcli.models.deltanet_layout import check_layers

    shapes = checkpoint.shapes
    if not shapes:  # no safetensors headers (pickled weights): transformers' loader checks them
        return
    try:
        check_layers(shapes, LeanConfig(plan.config), row, row.language_model or "model")
    except (KeyError, AttributeError, TypeError, ValueError, LeanUnsupported):
        return


def _checked(checkpoint: Checkpoint, plan: LoadPlan) -> NativeChoice:
    import torch

    from llmcli.models.device import DTYPE_NAMES
    from llmcli.models.lean_model import check_computes

    folder = checkpoint.path
    has_weights = checkpoint.read_in_place or any(folder.glob("*.safetensors"))
    if not has_weights or not checkpoint.has_tokenizer_json:
        raise LeanUnsupported("a folder without safetensors weights and a tokenizer.json")
    tokenizer = _lean_tokenizer(folder)  # before the weights: a refusal here costs nothing
    notes: tuple[str, ...] = ()
    stored = (plan.config.get("quantization_config") or {}).get("quant_method")
    row = family((plan.config.get("architectures") or [""])[0])
    if stored == "mxfp4" and row is not None and row.mxfp4_on_cpu and plan.device.type == "cpu":
        # As transformers' path does here (no MXFP4 kernel on a CPU), said as it says it.
        notes = (
            f"MXFP4 experts dequantized to {DTYPE_NAMES.get(plan.dtype, plan.dtype)}: llmcli has no "
            "MXFP4 kernel on cpu, so they take 4-8x their size on disk in memory",
        )
    elif plan.config.get("quantization_config"):
        raise LeanUnsupported("a checkpoint that comes quantized")
    if plan.settings.quant != "none" and plan.native_quant is None:
        raise LeanUnsupported(f"--quant {plan.settings.quant} (bitsandbytes)")
    device = plan.device
    if device.type == "cuda" and device.index is None and torch.cuda.device_count() > 1:
        raise LeanUnsupported("a model for several GPUs")
    with _config_as_written():
        config = LeanConfig(plan.config)
        tied = config.tie_word_embeddings
        check_computes(config)  # its activation and RoPE, before any weight is read
        if row is not None and row.layer_types == "gemma4" and not checkpoint.read_in_place:
            from llmcli.models.gemma4_layout import check_checkpoint

            # its layers' layout and tensors
            check_checkpoint(config, checkpoint.shapes, checkpoint.path, row.language_model or "model")
    return NativeChoice(tokenizer, config, tied, notes)


@contextlib.contextmanager
def _config_as_written() -> Iterator[None]:
    """A config field missing or of another shape, found while reading the config or building
    from it: transformers' path reads it, or says why."""
    try:
        yield
    except (KeyError, AttributeError, TypeError, ValueError) as error:
        raise LeanUnsupported(f"its config.json as written ({type(error).__name__}: {error})") from None


def build(
    checkpoint: Checkpoint, plan: LoadPlan, choice: NativeChoice, exact: ExactCodes | None, mtp: bool = False
) -> Built:
    """The model, its linear layers the quantizer reads from `exact` (a GGUF file's blocks) left
    as stand-ins (`mtp`: with its MTP module, lean_model.build). LeanUnsupported or
    DamagedCheckpoint where the files turn out otherwise."""
    from llmcli.models.lean_model import build as build_lean

    config = choice.config
    packed = plan.native_quant is not None and plan.device.type == "cpu"
    with _config_as_written():
        heads = (config.num_attention_heads, config.num_key_value_heads)
        tensors = checkpoint.tensors(plan.dtype, plan.device, heads)
        language_model = config.family.language_model
        if language_model is not None:  # a vision-language checkpoint: its text part
            from llmcli.models.language_model import LanguageModelTensors

            tensors = LanguageModelTensors(tensors, language_model)
        model = build_lean(tensors, config, _read_by_quantizer(exact, plan), packed, mtp)
    return Built(model, choice.tokenizer, notes=list(choice.notes))


def after_quantize(built: Built, choice: NativeChoice, plan: LoadPlan, model_name: str) -> None:
    """A tied head shares the quantized embedding's codes, and no stand-in is left to run on."""
    from llmcli.models.tensor_file import is_stand_in

    if plan.native_quant is not None and choice.tied:
        from llmcli.models.gguf_embedding import share_tied_head

        share_tied_head(built.model)
    unread = next((name for name, p in built.model.named_parameters() if is_stand_in(p)), None)
    if unread is not None:  # a stand-in the quantizer did not replace: never run on it
        raise LlmcliError(f"{model_name}: {unread} was not loaded (a bug in llmcli's lean loader)")


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

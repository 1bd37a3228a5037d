"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`): the Llama shape with two differences.

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, which the
shared Attention and FeedForward read as they are. RoPE may be partial (Phi-4-mini rotates 3/4
of each head; the rest passes unrotated) and of the `longrope` type: two sets of per-frequency
factors, the short ones for texts within the pretraining length and the long ones past it.
transformers switches between them by the length of the text so far; here the choice is made
once per load by the context in use — past the original length, the long factors for every
position, as llama.cpp does by its context size — so a chat's cached keys never change meaning.
"""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.native.families import llama
from llmcli.engine.native.families.base import Weights


def check_supported(model: Any, context_length: int) -> None:
    llama.check_supported(model, context_length, rope_types=llama.STATIC_ROPE_TYPES | {"longrope"})


def weights(model: Any, context_length: int) -> Weights:
    return llama.weights(model, context_length, rope=_rope(model, context_length))


def _rope(model: Any, context_length: int | None) -> tuple[torch.Tensor, float] | None:
    """longrope's frequencies for the context in use; None where transformers' table holds."""
    from llmcli.models.lean_config import longrope_frequencies

    config = model.config
    if _rope_parameters(config).get("rope_type") != "longrope":
        return None
    return longrope_frequencies(config, context_length or config.max_position_embeddings)


def _rope_parameters(config: Any) -> dict[str, Any]:
    from llmcli.models.lean_config import LeanConfig

    if isinstance(config, LeanConfig):  # a lean model's config, as it reads it (Phi-3's "su" too)
        return config.rope
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope if isinstance(rope, dict) else {}

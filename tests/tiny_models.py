"""Tiny models built offline in seconds: a BPE tokenizer trained on local text, random weights.

Used by the session fixtures in conftest.py; also importable by scripts/ for benchmarks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CONTEXT = 1024  # room for a 10-turn chat

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small model that answered questions quickly.",
    "Local models run on one GPU, or on a CPU when there is none.",
    "Streaming text appears token by token, as soon as each character is complete.",
    "Emoji split across tokens: 😀 🎉 🚀 👍🏽 and a family 👨‍👩‍👧.",
    "Chinese and Japanese: 你好，世界。今天天气很好。こんにちは、世界。日本語のテキスト。",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: ;:,.!?()[]{}",
    "def main():\n    print('hello world')\n\nif __name__ == '__main__':\n    main()\n",
    "A stop string may span the boundary between two tokens, and must never be printed.",
]


def train_tokenizer(
    vocab_size: int = 400,
    style: str = "bytelevel",
    added: tuple[str, ...] = (),
    special: tuple[str, ...] = (),
):
    """A BPE tokenizer: GPT-2/Qwen style ("bytelevel"), or Llama-2 style ("metaspace": ▁ for
    spaces, <0xNN> byte fallback for characters it never saw, and a stripped leading space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if style == "bytelevel":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        special_tokens, alphabet = SPECIAL_TOKENS, pre_tokenizers.ByteLevel.alphabet()
    else:
        backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<|endoftext|>"))
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        special_tokens, alphabet = SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)], []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(special_tokens),
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    if style != "bytelevel":
        # Byte tokens were reserved as "special" to get fixed ids; in Llama they are ordinary vocab,
        # which matters: skip_special_tokens must not drop them when decoding.
        data = json.loads(backend.to_str())
        for token in data["added_tokens"]:
            token["special"] = token["content"] in SPECIAL_TOKENS
        backend = Tokenizer.from_str(json.dumps(data))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    # Tokens a template family adds: `added` are text (Qwen's <tool_call>), `special` are not.
    tokenizer.add_tokens(list(added))
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


_LINEAR_ATTENTION = {  # Qwen3.5 and Qwen3-Next: a gated DeltaNet layer, then a full-attention one
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"],
}  # fmt: skip
_SMALL_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Gemma 4 on the native engine: sliding (window 8) and full layers in turn, the full ones wider
# (32) with one KV head and keys that are their values, the last two reading the KV of the two
# before them (one of each kind), per-layer inputs of 8, the shared layers' MLP double wide, and
# the logits soft-capped. "gemma4_moe" adds 4 experts of 32, 2 per token, beside each MLP.
# (Gemma 4 ran on transformers alone before: "gemma4_text" was one of FALLBACK_FAMILIES.)
GEMMA4 = {
    "num_hidden_layers": 6, "num_kv_shared_layers": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 3, "hidden_size_per_layer_input": 8,
    "use_double_wide_mlp": True, "final_logit_softcapping": 30.0,
}  # fmt: skip
GEMMA4_VARIANTS: dict[str, dict] = {
    "gemma4": GEMMA4,
    "gemma4_moe": GEMMA4
    | {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    # transformers' defaults elsewhere: full layers of 512 wide with their own values, no soft cap.
    "gemma4_text": {
        "num_hidden_layers": 4, "num_kv_shared_layers": 2, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 8,
    },
}  # fmt: skip
# Families whose cache layers cannot all be cropped back: a recurrent or convolution state, KV
# shared from another layer, a sliding window. Their config class, model class and what a 2-layer
# model of them needs. Those with a row in models/families.py run natively (runs_natively_by_default);
# the others only through transformers.
FALLBACK_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _LINEAR_ATTENTION),
    "qwen3_5_moe": (  # a shared expert of another width than the routed ones
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        _LINEAR_ATTENTION | _SMALL_EXPERTS | {"shared_expert_intermediate_size": 96},
    ),
    "qwen3_next": (  # its first layer dense (an `mlp_only_layers` one), the second sparse
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        _LINEAR_ATTENTION | _SMALL_EXPERTS | {"shared_expert_intermediate_size": 96, "mlp_only_layers": [0]},
    ),
    "lfm2": (  # a short convolution layer, then an attention one
        "Lfm2Config", "Lfm2ForCausalLM",
        {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False},
    ),
    "nemotron_h": (  # a Mamba-2 layer, then an attention one
        "NemotronHConfig", "NemotronHForCausalLM",
        {"layers_block_type": ["mamba", "attention"], "head_dim": 16, "mamba_num_heads": 4,
         "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16},
    ),
    "granitemoehybrid": (  # Granite 4: a Mamba-2 layer, then an attention one, both with experts
        "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
         "mamba_chunk_size": 16, "num_local_experts": 4, "shared_intermediate_size": 64},
    ),
    # Gemma 3n: Gemma 4's layout (GEMMA4_VARIANTS' "gemma4_text"), with AltUp and Laurel blocks besides
    "gemma3n_text": (
        "Gemma3nTextConfig", "Gemma3nForCausalLM",
        {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "head_dim": 16, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 8,
         "intermediate_size": [128] * 4, "activation_sparsity_pattern": [0.0] * 4, "laurel_rank": 8,
         "altup_num_inputs": 2},
    ),
    "olmo3": (  # a sliding layer with a window of 4, shorter than any prompt, and a full one
        "Olmo3Config", "Olmo3ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}  # fmt: skip
# Vision-language checkpoints whose text part the native engine runs: the config class and model
# class of the whole, the text family (above) its language model is, and a vision tower of
# 1 tiny block; their tokenizers hold Qwen's vision tokens, their templates write an image's marker.
MULTIMODAL_FAMILIES: dict[str, tuple[str, str, str]] = {
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}
_TINY_VISION = {
    "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
    "out_hidden_size": 64, "num_position_embeddings": 16, "initializer_range": 0.2,
}  # fmt: skip
# Vision-language checkpoints whose vision tower llmcli runs (models/vision/qwen_vl.py): the
# multimodal families above, and those whose text part has no row in the native engine's table
# (Qwen2.5-VL's is Qwen2 with multimodal RoPE, Qwen3-VL's Qwen3 with it and deepstack rows).
VISION_FAMILIES: dict[str, tuple[str, str, str]] = MULTIMODAL_FAMILIES | {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3"),
}
# Each tiny checkpoint's image processor: patches of 4, merged 2×2, images resized to between 1 and
# 16 merged patches (but for a long thin one: its short side one merged patch). Qwen3.5 spells the
# bounds as Qwen3-VL's released preprocessor_config.json does, Qwen2.5-VL as its own.
_QWEN3_PREPROCESSOR = {"size": {"shortest_edge": 64, "longest_edge": 1024}, "image_mean": [0.5] * 3,
                       "image_std": [0.5] * 3, "patch_size": 4}  # fmt: skip
_QWEN3_VISION = (_TINY_VISION, {"mrope_section": [1, 1, 0], "mrope_interleaved": True}, _QWEN3_PREPROCESSOR)
# Per text family: its tiny vision tower, its multimodal RoPE sections as the released configs
# carry them (Qwen3.5: interleaved over the 2 frequencies of a head's rotated quarter; Qwen2.5-VL:
# chunked over a whole head's 8), and its preprocessor_config.json. Qwen2.5-VL's tower: a windowed
# block (windows of 2×2 merged patches), then a full one. Qwen3-VL's: two blocks, each giving
# deepstack rows (for the decoder's two layers), interleaved over a whole head's 8 frequencies.
_VISION_PARTS: dict[str, tuple[dict, dict, dict]] = {
    "qwen3_5": _QWEN3_VISION,
    "qwen3_5_moe": _QWEN3_VISION,
    "qwen2": (
        {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
         "out_hidden_size": 64, "window_size": 16, "fullatt_block_indexes": [1], "initializer_range": 0.2},
        {"mrope_section": [2, 3, 3]},
        {"min_pixels": 64, "max_pixels": 1024, "patch_size": 4},
    ),
    "qwen3": (
        _TINY_VISION | {"depth": 2, "deepstack_visual_indexes": [0, 1]},
        {"mrope_section": [3, 3, 2], "mrope_interleaved": True},
        _QWEN3_PREPROCESSOR,
    ),
}  # fmt: skip
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# The Qwen template's image branch, shortened: an image part becomes the marker the processor
# expands (one <|image_pad|> per merged patch).
VISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vision_language_model(folder: Path) -> Any:
    """transformers' whole model of a VISION_FAMILIES checkpoint that build_tiny_model saved in a
    folder named after its arch, vision tower and all, in fp32: the reference."""
    import torch
    import transformers

    model_class = getattr(transformers, VISION_FAMILIES[folder.name][1])
    return model_class.from_pretrained(folder, dtype=torch.float32).eval()


# Gemma vision-language checkpoints whose vision part llmcli runs (models/vision/gemma3.py and
# gemma4.py): the model class of the whole, the text arch its language model is, the image tokens
# its tokenizer names (special, with tokenizer_config.json's names for them) and which of them the
# chat template writes for an image, a tiny vision tower, and the image processor's settings.
GEMMA_VISION: dict[str, dict[str, Any]] = {
    "gemma3_vl": {
        "model": "Gemma3ForConditionalGeneration",
        "text": "gemma3_text",
        "tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                   "image_token": "<image_soft_token>"},
        "marker": "boi_token",
        # SigLIP on 32 × 32 images in patches of 8: a 4 × 4 grid pooled to 2 × 2 rows
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "image_size": 32, "patch_size": 8, "vision_use_head": False},
        "config": {"mm_tokens_per_image": 4},
        "processor": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 32, "width": 32},
                      "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": None,
                      "image_seq_length": 4, "processor_class": "Gemma3Processor"},
    },
    "gemma4_vl": {
        "model": "Gemma4ForConditionalGeneration",
        "text": "gemma4",
        "tokens": {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"},
        "marker": "image_token",
        # patches of 4 pooled 3 × 3: at most 70 rows (the fewest the processor allows) of 630 patches,
        # an image resized to about 100 × 100 (or one side up to 210 patches); the pooled rows
        # standardized, as the released towers do
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4,
                   "pooling_kernel_size": 3, "position_embedding_size": 256, "standardize": True},
        "config": {"text": {"use_bidirectional_attention": "vision"}},
        "processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4,
                      "pooling_kernel_size": 3, "max_soft_tokens": 70, "image_seq_length": 70,
                      "processor_class": "Gemma4Processor"},
    },
}  # fmt: skip
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def gemma_vision_template(marker: str) -> str:
    """Gemma's chat template, shortened: turns of `user` and `model`, a message's parts in order,
    `marker` where a part is an image."""
    return (
        "{% for message in messages %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] | trim }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '" + marker + "' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    )


def runs_natively_by_default(arch: str) -> bool:
    """Whether auto loads a FALLBACK_FAMILIES `arch` on the native engine: its model class has a
    row in the families table that auto picks."""
    from llmcli.models.families import family

    row = family(FALLBACK_FAMILIES[arch][1])
    return row is not None


def build_tiny_model(
    folder: Path,
    arch: str,
    *,
    chat_template: bool | str = True,
    seed: int = 0,
    added: tuple[str, ...] = (),
    special: tuple[str, ...] = (),
    tokenizer_style: str = "bytelevel",
) -> Path:
    """Save a 2-layer `arch` ("llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "gpt_oss", "gemma3_text",
    one of FALLBACK_FAMILIES, VISION_FAMILIES, GEMMA_VISION or GEMMA4_VARIANTS) model with
    random weights and a trained tokenizer of `tokenizer_style` (train_tokenizer), with
    `chat_template` as its template when it is text."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    vision = GEMMA_VISION.get(arch)
    if vision is not None:  # its turn and image tokens special, its template Gemma's
        special += TURN_TOKENS + tuple(vision["tokens"].values())
        chat_template = gemma_vision_template(vision["tokens"][vision["marker"]])
        arch = vision["text"]
    multimodal = VISION_FAMILIES.get(arch)
    if multimodal is not None:
        special += VISION_TOKENS
        chat_template = VISION_TEMPLATE if chat_template is True else chat_template
    tokenizer = train_tokenizer(style=tokenizer_style, added=added, special=special)
    if vision is not None:
        tokenizer.eos_token = "<end_of_turn>"
    if not chat_template:
        tokenizer.chat_template = None
    elif isinstance(chat_template, str):
        tokenizer.chat_template = chat_template
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": TINY_CONTEXT,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "bos_token_id": pad,
    }
    if arch == "qwen3":
        shape["head_dim"] = 16
    if arch == "qwen3_moe":  # 4 experts of 48, 2 per token
        shape |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 16}
    if arch == "gpt_oss":  # a sliding layer (window 8) and a full one, 4 experts of 64, 2 per token
        shape |= {
            "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "head_dim": 16,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {  # YaRN from 128 to the context (gpt-oss: 4096 to 131072)
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": TINY_CONTEXT / 128, "truncate": False,
                "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
            },
        }  # fmt: skip
    if arch == "gemma3_text":  # a sliding layer (window 8) and a global one
        shape |= {
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
        }
    if multimodal is not None:
        arch = multimodal[2]
    if arch in GEMMA4_VARIANTS or arch == "gemma4_vision":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        shape |= GEMMA4_VARIANTS.get(arch, GEMMA4)
        shape["vocab_size_per_layer_input"] = shape["vocab_size"]  # per-layer inputs: the whole vocabulary
        config_class, model_class = Gemma4TextConfig, Gemma4ForCausalLM
        if (
            arch == "gemma4_vision"
        ):  # GEMMA4's text model inside the multimodal checkpoint, a tiny vision tower
            config_class, model_class = _gemma4_with_vision()
    elif arch in FALLBACK_FAMILIES:
        import transformers

        config_name, model_name, extra = FALLBACK_FAMILIES[arch]
        shape |= extra
        if "hidden_size_per_layer_input" in extra:  # Gemma's per-layer embeddings: the whole vocabulary
            shape["vocab_size_per_layer_input"] = shape["vocab_size"]
        config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    else:
        config_class, model_class = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "phi3": (Phi3Config, Phi3ForCausalLM),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "gpt_oss": (GptOssConfig, GptOssForCausalLM),
            "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
        }[arch]
    torch.manual_seed(seed)
    # A larger init than the default 0.02 gives peaked, varied logits instead of near-ties.
    config = config_class(**shape, initializer_range=0.2)
    if multimodal is not None:  # the text model's config inside the whole's, beside a vision one
        import transformers

        config_class, model_class = (getattr(transformers, name) for name in multimodal[:2])
        text = config.to_dict()
        tower, mrope, preprocessor = _VISION_PARTS[arch]
        text["rope_parameters"] |= mrope
        start, pad, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        config = config_class(
            text_config=text,
            vision_config=tower,
            image_token_id=pad,
            vision_start_token_id=start,
            vision_end_token_id=end,
            initializer_range=0.2,
        )
    if vision is not None:
        config, model_class = _gemma_vision(vision, config, tokenizer)
    model = model_class(config)
    projector = getattr(getattr(model, "model", None), "multi_modal_projector", None)
    if projector is not None and hasattr(projector, "mm_input_projection_weight"):
        with torch.no_grad():  # Gemma 3's projection starts at zero: every image would be the same rows
            projector.mm_input_projection_weight.normal_(0.0, 0.2)
    if arch in GEMMA4_VARIANTS:
        _away_from_one(model)
    if arch == "gemma4_vision":  # its language model the very "gemma4" model, the tower random
        _away_from_one(model)
        torch.manual_seed(seed)
        text = Gemma4ForCausalLM(Gemma4TextConfig(**shape, initializer_range=0.2))
        _away_from_one(text)
        model.model.language_model.load_state_dict(text.model.state_dict())
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if vision is not None:
        _save_gemma_vision_files(folder, vision)
    if multimodal is not None:
        processor = {
            "image_processor_type": "Qwen2VLImageProcessor",
            "merge_size": 2,
            "temporal_patch_size": 2,
        }
        (folder / "preprocessor_config.json").write_text(json.dumps(processor | preprocessor))
    return folder


def _gemma_vision(vision: dict[str, Any], text: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The whole model's config around the text model's `text` (a tiny vision tower beside it, its
    image tokens the tokenizer's), and the model class."""
    import transformers

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in vision["tokens"].items()}
    text_config = text.to_dict() | vision["config"].get("text", {})
    model_class = getattr(transformers, vision["model"])
    if vision["text"] == "gemma3_text":
        config = transformers.Gemma3Config(
            text_config=text_config,
            vision_config=vision["vision"],
            mm_tokens_per_image=vision["config"]["mm_tokens_per_image"],
            boi_token_index=ids["boi_token"],
            eoi_token_index=ids["eoi_token"],
            image_token_index=ids["image_token"],
            initializer_range=0.2,
        )
        return config, model_class
    config = transformers.Gemma4Config(
        text_config=text_config,
        vision_config=vision["vision"],
        audio_config=None,
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"],
        initializer_range=0.2,
    )
    return config, model_class


def _save_gemma_vision_files(folder: Path, vision: dict[str, Any]) -> None:
    """The image tokens named in tokenizer_config.json (as Gemma's released tokenizers name them:
    transformers' processors read them so), and the image processor's settings: Gemma 3's flat in
    preprocessor_config.json as its released folders have them, Gemma 4's in
    processor_config.json as transformers 5 saves them."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | vision["tokens"], indent=2))
    settings = vision["processor"]
    if vision["text"] == "gemma3_text":
        (folder / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))
        return
    outer = {"image_seq_length": settings["image_seq_length"], "processor_class": settings["processor_class"]}
    inner = {key: value for key, value in settings.items() if key not in outer}
    (folder / "processor_config.json").write_text(json.dumps(outer | {"image_processor": inner}, indent=2))


def _away_from_one(model: Any) -> None:
    """Gemma 4's norms, scales and layer scalars away from their init of 1, so a norm scaling by
    1 + weight, or a scale left out, shows."""
    import torch

    with torch.no_grad():
        for vector in [*model.parameters(), *model.buffers()]:
            if vector.dim() == 1 and vector.is_floating_point():
                vector.uniform_(0.5, 1.5)


def _gemma4_with_vision() -> tuple[Any, Any]:
    """Gemma4ForConditionalGeneration's config from a text config's values (a one-layer vision
    tower of 32, no audio), and the model class."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip

    def config(initializer_range: float, **text: Any) -> Any:
        return Gemma4Config(
            text_config=text | {"initializer_range": initializer_range},
            vision_config=vision,
            audio_config=None,
            initializer_range=initializer_range,
        )

    return config, Gemma4ForConditionalGeneration


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a made-up revision for the HF cache layout


def put_in_hf_cache(model_folder: Path, hf_home: Path, repo_id: str) -> Path:
    """Lay a model out as huggingface_hub's cache does: blobs, a snapshot per commit, refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in model_folder.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def mxfp4_experts(folder: Path, seed: int = 0) -> Path:
    """A saved gpt-oss model's stacked experts replaced by random MXFP4 blocks and scales, as the
    released checkpoints store them: 32 values of 4 bits per block, one power-of-two scale each."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor
            continue
        experts, inputs, outputs = tensor.shape  # held [E, in, out]; stored [E, out, in / 32, …]
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8
        )
        tensors[f"{name}_scales"] = torch.randint(
            122, 128, (experts, outputs, inputs // 32), generator=generator, dtype=torch.uint8
        )  # scales of 2^-5 … 2^0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# SmolVLM and Idefics3: config class and model class of the whole. Their decoder is a Llama; their
# vision tower takes tiles of 32 pixels in patches of 8, 4 × 4 patches shuffled into 2 × 2 rows.
IDEFICS3_FAMILIES: dict[str, tuple[str, str]] = {
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
}
IDEFICS3_TOKENS = (
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)  # fmt: skip
IDEFICS3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ':' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<end_of_utterance>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Tiles of 32 pixels, images resized to at most 64 on their longest side: at most 2 × 2 tiles.
IDEFICS3_PREPROCESSOR = {
    "do_image_splitting": True, "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32},
}  # fmt: skip


def build_tiny_idefics3(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny `arch` (IDEFICS3_FAMILIES) checkpoint: a 2-layer Llama of build_tiny_model's
    shape as its text model, a 1-layer vision tower, the processor's tokens added to the
    tokenizer, a template writing `<image>` for an image part, and a preprocessor_config.json."""
    import torch
    import transformers

    config_name, model_name = IDEFICS3_FAMILIES[arch]
    tokenizer = train_tokenizer(special=IDEFICS3_TOKENS)
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = {
        "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": TINY_CONTEXT, "eos_token_id": eos, "pad_token_id": pad,
        "bos_token_id": pad, "initializer_range": 0.2,
    }  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8, "initializer_range": 0.2}  # fmt: skip
    config = getattr(transformers, config_name)(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor_type = f"{config_name.removesuffix('Config')}ImageProcessor"
    settings = IDEFICS3_PREPROCESSOR | {"image_processor_type": processor_type}
    (folder / "preprocessor_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder

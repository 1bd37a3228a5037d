"""Qwen3.5's multi-token-prediction (MTP) module, run on the native engine to draft tokens.

transformers has no MTP code: `Qwen3_5ForCausalLM` lists `mtp.*` among the tensors it ignores
at load. What follows was learned from the serving engines that run it, read on 2026-11-27:
vLLM's `vllm/model_executor/models/qwen3_5_mtp.py` (Qwen3_5MultiTokenPredictor) and
`qwen3_next_mtp.py`, SGLang's `python/sglang/srt/models/qwen3_next_mtp.py`
(Qwen3NextForCausalLMMTP), vLLM's `qwen3_next.py` (Qwen3NextModel.forward) and its EAGLE/MTP
proposer (`vllm/v1/spec_decode/eagle.py`, `llm_base_proposer.py`: set_inputs_first_pass); the
tensor list matches the published Qwen3.5 checkpoints' (e.g. Qwen3.5-4B's index: `mtp.fc.weight`
[2560, 5120], `mtp.layers.0.self_attn.q_proj.weight` [8192, 2560], …).

Tensors (one MTP layer in every Qwen3.5/3.6 release, `mtp_num_hidden_layers: 1`):
    mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight   [hidden]
    mtp.fc.weight                                                       [hidden, 2 × hidden], no bias
    mtp.layers.0.*   one decoder layer of the full-attention kind, as the body's: input_layernorm,
                     self_attn.{q_proj (query and gate, doubled), k_proj, v_proj, o_proj, q_norm,
                     k_norm}, post_attention_layernorm, mlp.{gate,up,down}_proj (experts in MoE)
    mtp.norm.weight                                                     [hidden]
In Qwen3.5-MoE and Qwen3-Next (vLLM's qwen3_next_mtp.py: the same module) the layer's MLP is
the body's sparse block: mlp.gate (the router), mlp.experts (one tensor per expert, or stacked
`experts.gate_up_proj`/`experts.down_proj` as Qwen3.5-MoE's release stores the body's too; vLLM's
Qwen3_5MultiTokenPredictor.load_weights reads both), mlp.shared_expert.* and
mlp.shared_expert_gate; the loader reads it as a body layer's (models/lean_model.py: _layer).
Every norm is Qwen3.5's (1 + weight) RMSNorm. The embedding and lm_head are the main model's
(`mtp_use_dedicated_embeddings` is false; vLLM and SGLang read `embed_tokens`/`lm_head` into it).

Forward, for a main-model position p (token t_p) whose next token t_{p+1} is known:
    x = fc(concat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))   (embedding first)
    x = layer(x) at RoPE position p, attending over the MTP layer's own KV cache
    out = norm(x);  logits = lm_head(out): the token at p + 2
h_p is the main model's hidden state at p after its final norm, the very input of lm_head
(vLLM's Qwen3NextModel.forward returns `self.norm(hidden, residual)` and the proposer feeds that;
SGLang feeds the logits processor's hidden states, the same). vLLM shifts the ids by one and
keeps the target positions ("rotate the input ids and leave the positions unchanged"), so entry
p sits at position p. The MTP layer's KV cache covers the whole sequence: each pass of the main
model (prefill, the check of a draft) runs its accepted rows through the MTP module as well.
Drafting k tokens then chains: the first draft d_1 comes from the entry at the last position
n − 1 (h_{n−1}, the chosen token t_n); entry n takes embed(d_1) with the MTP module's own `out`
in the place of h_n (vLLM: the draft model's returned hidden states), and gives d_2; and so on.
Those chained entries are guesses: they are cropped before the next round, where the main
model's own h_n has come.

Here the entries sit in a one-layer KVCache whose slot j is main position `offset + j` (RoPE at
the slot: attention depends on distances only, so an offset changes nothing but rounding);
`MtpHead` runs them and the drafter (engine/speculative/drafters.py: MtpDrafter) decides which.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from llmcli.engine.native.families.gemma3 import GemmaRMSNorm
from llmcli.engine.native.families.qwen3_5 import GatedAttention, GatedBlock
from llmcli.engine.native.families.shared_expert import feed_forward
from llmcli.engine.native.kvcache import KVCache
from llmcli.engine.native.layers import projection
from llmcli.engine.native.plans import CausalChunk

if TYPE_CHECKING:
    from llmcli.engine.native.forward import Transformer


class MtpHead:
    """`model`'s MTP module (`model.mtp`, models/lean_model.py) over its own KV cache, beside
    `net` (the main model: its embedding, RoPE and lm_head)."""

    def __init__(self, model: Any, net: Transformer, context_length: int) -> None:
        mtp = model.mtp
        self.net = net
        eps = net.shape.eps
        self.embedding_norm = GemmaRMSNorm(mtp.pre_fc_norm_embedding.weight, eps)
        self.hidden_norm = GemmaRMSNorm(mtp.pre_fc_norm_hidden.weight, eps)
        self.fc = projection(mtp.fc)
        shape = dataclasses.replace(net.shape, layers=1)
        layer = mtp.layers[0]
        attention = GatedAttention(layer.self_attn, shape, 0, norm=GemmaRMSNorm)
        # Its MLP as the body's layers have theirs: dense, or experts beside a shared one.
        mlp = feed_forward(layer.mlp, bool(getattr(model.config, "norm_topk_prob", True)))
        self.block = GatedBlock(layer, attention, eps, mlp)
        self.norm = GemmaRMSNorm(mtp.norm.weight, eps)
        self.cache = KVCache(1, shape.kv_heads, shape.head_dim, context_length, net.dtype, net.device)

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries for `tokens` [T] (each the token after its row's position) and `hidden`
        [T, hidden] (the main model's final-norm output there, or the last entry's own), after
        what the cache holds: every row's output after the MTP norm [T, hidden] (a next entry's
        hidden), and the logits of the last row [1, vocab]."""
        net = self.net
        plan = CausalChunk(self.cache, tokens.shape[0], net.device)
        cos, sin = net.rope(plan.positions)
        both = torch.cat((self.embedding_norm(net.embed(tokens)), self.hidden_norm(hidden)), dim=-1)
        x = self.block(self.fc(both).to(net.residual_dtype), cos, sin, plan)
        plan.finish()
        out = self.norm(x)
        return out, net.output(out[-1:]).float()

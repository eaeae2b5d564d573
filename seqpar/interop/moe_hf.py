"""Hugging Face Mixtral and Qwen3-MoE <-> seqpar GPT with ``model.moe``.

Both are Llama-family decoders (:mod:`seqpar.interop.llama` converts what they share) whose MoE
layers hold, in ``transformers`` >= 5, a router ``mlp.gate.weight [E, h]`` and fused experts
``mlp.experts.gate_up_proj [E, 2f, h]`` (``[gate; up]`` rows, as seqpar's ``experts.w1``) and
``mlp.experts.down_proj [E, h, f]`` (seqpar's ``experts.w2``): tensors map one to one. Qwen3-MoE
adds QK-norm (``self_attn.{q,k}_norm``: seqpar's ``qk_norm=True``), dense layers
(``mlp_only_layers`` = the first ``moe.first_dense`` layers, ``decoder_sparse_step`` =
``moe.every``) and ``norm_topk_prob``; Mixtral renormalises the top-k weights and has every layer
MoE. The auxiliary-loss coefficient maps to seqpar's per-layer loss (Hugging Face pools every
layer's router statistics and leaves out seqpar's ``1/k``: ``aux_loss_coeff = k x
router_aux_loss_coef``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UserError
from ..model.config import GPTConfig, MoEConfig
from . import llama

KINDS = ("mixtral", "qwen3_moe")


def hf_names(config: GPTConfig) -> llama.Entries:
    """Where each dense tensor of ``config`` goes in a Mixtral / Qwen3-MoE state dict."""
    out = llama.hf_names(config)
    for i in range(config.layers):
        pre, ours = f"model.layers.{i}.", f"blocks.{i}."
        if config.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[f"{ours}attn.qk_norm.{n}.weight"] = [(f"{pre}self_attn.{n}.weight", 0, None)]
        if config.moe is not None and config.moe.is_moe_layer(i):
            for dense in ("fc1", "fc2"):
                out.pop(f"{ours}mlp.{dense}.weight")
            out[f"{ours}mlp.router.weight"] = [(f"{pre}mlp.gate.weight", 0, None)]
            out[f"{ours}mlp.experts.w1"] = [(f"{pre}mlp.experts.gate_up_proj", 0, None)]
            out[f"{ours}mlp.experts.w2"] = [(f"{pre}mlp.experts.down_proj", 0, None)]
    return out


def _moe_fields(c, kind: str) -> dict:
    """GPTConfig fields (``moe``, ``qk_norm``, ``ffn_hidden``) of a Hugging Face MoE config."""
    if kind == "mixtral":
        if float(getattr(c, "router_jitter_noise", 0.0) or 0.0) > 0:
            raise UserError(f"from_hf: router_jitter_noise={c.router_jitter_noise} has no seqpar equivalent")
        if getattr(c, "sliding_window", None) is not None:
            raise UserError(f"from_hf: sliding_window={c.sliding_window} has no seqpar equivalent")
        k = c.num_experts_per_tok
        moe = MoEConfig(experts=c.num_local_experts, top_k=k, norm_topk=True, aux_loss_coeff=k * c.router_aux_loss_coef)
        return dict(moe=moe, ffn_hidden=c.intermediate_size)
    dense = sorted(c.mlp_only_layers or [])
    if dense != list(range(len(dense))):
        raise UserError(f"from_hf: mlp_only_layers={dense} must be the first layers (seqpar's moe.first_dense)")
    if getattr(c, "use_sliding_window", False):
        raise UserError("from_hf: use_sliding_window=True has no seqpar equivalent")
    k = c.num_experts_per_tok
    moe = MoEConfig(experts=c.num_experts, top_k=k, ffn_hidden=c.moe_intermediate_size, every=c.decoder_sparse_step,
                    first_dense=len(dense), norm_topk=bool(c.norm_topk_prob), aux_loss_coeff=k * c.router_aux_loss_coef)
    return dict(moe=moe, qk_norm=True)


def from_hf(hf_model: nn.Module, **overrides) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(GPTConfig, dense_state_dict)`` of a ``transformers`` Mixtral or Qwen3-MoE model;
    ``overrides`` set other :class:`GPTConfig` fields. Load with ``GPT(config, mesh)
    .load_dense_state_dict(state)`` at any layout (tp, ep) the config allows."""
    c = hf_model.config
    kind = getattr(c, "model_type", None)
    if kind not in KINDS:
        raise UserError(f"from_hf: model_type {kind!r} is not one of {list(KINDS)}")
    sd = llama.hf_state(hf_model)
    config = llama.config_from_hf(c, sd, **{**_moe_fields(c, kind), **overrides})
    return config, llama.gather_state(hf_names(config), sd)


def hf_config(config: GPTConfig, kind: str, **hf_kwargs):
    """The ``MixtralConfig`` or ``Qwen3MoeConfig`` of ``config`` (refusing what it cannot hold)."""
    llama.check_llama(config)
    moe = config.moe
    if moe is None or moe.router != "softmax" or moe.shared_experts or moe.route_scale != 1.0 or config.bias:
        raise ValueError(f"{kind} needs model.moe with the softmax router, no shared experts, route_scale 1 and no "
                         f"biases; got moe={moe}, bias={config.bias}")
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden, num_hidden_layers=config.layers,
                  num_attention_heads=config.heads, num_key_value_heads=config.num_kv_heads, hidden_act="silu",
                  max_position_embeddings=config.seq_len, initializer_range=config.init_std,
                  rms_norm_eps=config.layernorm_eps, tie_word_embeddings=config.tie_embeddings,
                  rope_parameters=llama._rope_parameters(config), attention_dropout=config.attention_dropout,
                  head_dim=config.head_dim, num_experts_per_tok=moe.top_k,
                  router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k, **hf_kwargs)
    f = moe.expert_ffn(config.ffn_hidden)
    if kind == "mixtral":
        from transformers import MixtralConfig
        if config.qk_norm or not moe.norm_topk or moe.every != 1 or moe.first_dense or f != config.ffn_hidden:
            raise ValueError("Mixtral has every layer MoE, renormalised top-k weights and no QK-norm")
        return MixtralConfig(intermediate_size=f, num_local_experts=moe.experts, **common)
    from transformers import Qwen3MoeConfig
    if not config.qk_norm:
        raise ValueError("Qwen3-MoE needs qk_norm=True")
    return Qwen3MoeConfig(intermediate_size=config.ffn_hidden, moe_intermediate_size=f, num_experts=moe.experts,
                          decoder_sparse_step=moe.every, mlp_only_layers=list(range(moe.first_dense)),
                          norm_topk_prob=moe.norm_topk, **common)


def to_hf(config: GPTConfig, dense_state_dict: dict[str, torch.Tensor], kind: str = "mixtral", **hf_kwargs):
    """A ``MixtralForCausalLM`` (``kind="mixtral"``) or ``Qwen3MoeForCausalLM`` (``"qwen3_moe"``)
    holding ``dense_state_dict`` (as from :meth:`GPT.dense_state_dict` or :func:`from_hf`)."""
    import transformers

    cls = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]
    model = getattr(transformers, cls)(hf_config(config, kind, **hf_kwargs)).to(config.torch_dtype)
    names = hf_names(config)
    missing, unexpected = sorted(set(names) - set(dense_state_dict)), sorted(set(dense_state_dict) - set(names))
    if missing or unexpected:
        raise ValueError(f"to_hf: dense state dict mismatch: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for ours, parts in names.items():
            for theirs, r0, rows in parts:
                w = dense_state_dict[ours] if rows is None else dense_state_dict[ours].narrow(0, r0, rows)
                if w.shape != params[theirs].shape:
                    raise ValueError(f"to_hf: {theirs} would get shape {tuple(w.shape)}, expected "
                                     f"{tuple(params[theirs].shape)}")
                params[theirs].copy_(w)
    return model


__all__ = ["KINDS", "from_hf", "hf_config", "hf_names", "to_hf"]

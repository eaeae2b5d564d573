"""Hugging Face Llama <-> seqpar GPT, through seqpar's layout-invariant dense state dict.

``from_hf`` reads a ``LlamaForCausalLM`` (or ``LlamaModel``) into a :class:`GPTConfig`
(``norm="rmsnorm"``, ``position="rope"``, ``mlp="swiglu"``, ``kv_heads``) and the full tensors
:meth:`GPT.load_dense_state_dict` slices for any TP size; ``to_hf`` builds the
``LlamaForCausalLM`` back. Both use ``nn.Linear``'s ``[out, in]`` layout, so nothing is
transposed: ``q_proj``, ``k_proj``, ``v_proj`` are the ``[q; k; v]`` rows of ``attn.qkv``,
``gate_proj`` and ``up_proj`` the ``[gate; up]`` rows of ``mlp.fc1``. Both sides rotate with
the rotate-half convention, so the weights load as they are. :func:`hf_tensors` and
:func:`hf_config` are the pieces ``seqpar export`` streams from.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..errors import UserError
from ..model.config import DTYPES, GPTConfig, RopeScaling

_LAYER = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
          "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
          "mlp.fc2.weight": "mlp.down_proj.weight", "mlp.fc2.bias": "mlp.down_proj.bias"}
_FUSED = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.fc1": ("mlp.gate_proj", "mlp.up_proj")}

# seqpar dense name -> [(HF name, first row, rows)]; rows None = the whole tensor
Entries = dict[str, list[tuple[str, int, int | None]]]


def hf_names(config: GPTConfig) -> Entries:
    """Where each dense tensor of ``config`` goes in a ``LlamaForCausalLM`` state dict: fused
    tensors are split by rows (q, k, v: ``a d``, ``g d``, ``g d``; gate, up: ``f``, ``f``)."""
    d, f = config.head_dim, config.ffn_hidden
    sizes = {"attn.qkv": (config.heads * d, config.num_kv_heads * d, config.num_kv_heads * d), "mlp.fc1": (f, f)}
    out: Entries = {"wte.weight": [("model.embed_tokens.weight", 0, None)],
                    "ln_f.weight": [("model.norm.weight", 0, None)]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", 0, None)]
    suffixes = ("weight", "bias") if config.bias else ("weight",)
    for i in range(config.layers):
        pre = f"model.layers.{i}."
        out.update({f"blocks.{i}.{k}": [(pre + v, 0, None)] for k, v in _LAYER.items()
                    if config.bias or not k.endswith("bias")})
        for ours, theirs in _FUSED.items():
            starts = [sum(sizes[ours][:j]) for j in range(len(theirs))]
            for sfx in suffixes:
                out[f"blocks.{i}.{ours}.{sfx}"] = [(f"{pre}{n}.{sfx}", r0, n_rows)
                                                  for n, r0, n_rows in zip(theirs, starts, sizes[ours])]
    return out


def hf_tensors(config: GPTConfig, dense: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` pairs, one dense tensor read (``dense(name)``) at a time."""
    for ours, parts in hf_names(config).items():
        w = dense(ours)
        for theirs, r0, rows in parts:
            yield theirs, (w if rows is None else w.narrow(0, r0, rows))


def _rope_parameters(config: GPTConfig) -> dict:
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    return {"rope_type": "llama3", "rope_theta": float(config.rope_theta), **asdict(config.rope_scaling)}


def check_llama(config: GPTConfig) -> None:
    """``ValueError`` naming every field that a Llama model cannot express."""
    config.validate()
    wrong = {k: getattr(config, k) for k, want in (("norm", "rmsnorm"), ("position", "rope"), ("mlp", "swiglu"))
             if getattr(config, k) != want}
    if wrong:
        raise ValueError(f"a Llama model needs norm='rmsnorm', position='rope', mlp='swiglu'; got {wrong}")


def hf_config(config: GPTConfig, **hf_kwargs):
    """The ``transformers.LlamaConfig`` of ``config`` (``hf_kwargs`` passed on)."""
    from transformers import LlamaConfig

    check_llama(config)
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden, intermediate_size=config.ffn_hidden,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.num_kv_heads,
        hidden_act="silu", max_position_embeddings=config.seq_len, initializer_range=config.init_std,
        rms_norm_eps=config.layernorm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters=_rope_parameters(config), attention_bias=config.bias, mlp_bias=config.bias,
        attention_dropout=config.attention_dropout, head_dim=config.head_dim, **hf_kwargs)


def _rope_of(c) -> tuple[float, RopeScaling | None, list[str]]:
    """``(rope_theta, rope_scaling, unsupported)`` of a Hugging Face Llama config (v4 or v5 style)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    legacy = getattr(c, "rope_scaling", None)
    if not params:
        params = {"rope_theta": getattr(c, "rope_theta", 10000.0), **(legacy or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if kind == "default":
        return theta, None, []
    if kind != "llama3":
        return theta, None, [f"rope_type={kind!r}"]
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, RopeScaling(**{k: params[k] for k in fields}), []


def hf_state(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a ``...ForCausalLM`` or bare ``...Model`` (keys under ``model.``), detached."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    if not any(k.startswith("model.") for k in sd):  # a bare LlamaModel
        sd = {f"model.{k}": v for k, v in sd.items()}
    return sd


def config_from_hf(c, sd: dict[str, torch.Tensor], **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a Llama-family Hugging Face config ``c`` (its state dict ``sd``
    tells tied embeddings and the dtype); ``overrides`` set other fields. Refuses what seqpar's
    GPT cannot express, naming the options."""
    d = c.hidden_size // c.num_attention_heads
    theta, scaling, unsupported = _rope_of(c)
    if c.hidden_act != "silu":
        unsupported.append(f"hidden_act={c.hidden_act!r}")
    if (getattr(c, "head_dim", None) or d) != d:
        unsupported.append(f"head_dim={c.head_dim} (seqpar uses hidden_size / num_attention_heads = {d})")
    if bool(getattr(c, "attention_bias", False)) != bool(getattr(c, "mlp_bias", False)):
        unsupported.append(f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}")
    if (getattr(c, "pretraining_tp", 1) or 1) > 1:
        unsupported.append(f"pretraining_tp={c.pretraining_tp}")
    if unsupported:
        raise UserError(f"from_hf: seqpar's GPT has no equivalent of Llama option(s) {unsupported}")
    tied = bool(getattr(c, "tie_word_embeddings", False)) or "lm_head.weight" not in sd
    dtype = next(name for name, dt in DTYPES.items() if dt == sd["model.embed_tokens.weight"].dtype)
    fields = dict(vocab_size=c.vocab_size, seq_len=c.max_position_embeddings, hidden=c.hidden_size,
                  heads=c.num_attention_heads, layers=c.num_hidden_layers, ffn_hidden=c.intermediate_size,
                  kv_heads=c.num_key_value_heads or c.num_attention_heads, dropout=0.0,
                  attention_dropout=float(c.attention_dropout or 0.0), tie_embeddings=tied,
                  layernorm_eps=c.rms_norm_eps, bias=bool(getattr(c, "attention_bias", False)),
                  init_std=c.initializer_range, norm="rmsnorm", position="rope", rope_theta=theta,
                  rope_scaling=scaling, mlp="swiglu", dtype=dtype)
    fields.update(overrides)
    config = GPTConfig(**fields)
    check_llama(config)
    return config


def from_hf(hf_model: nn.Module, **overrides) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(GPTConfig, dense_state_dict)`` of a ``transformers`` Llama model. ``overrides`` set other
    :class:`GPTConfig` fields (``sequence_parallel``, ``recompute``, ``seq_len`` ...). Load the
    result with ``GPT(config, mesh).load_dense_state_dict(state)`` at any TP size dividing the
    heads, key/value heads and widths (the vocabulary is padded inside the model)."""
    sd = hf_state(hf_model)
    config = config_from_hf(hf_model.config, sd, **overrides)
    return config, gather_state(hf_names(config), sd)


def gather_state(names: Entries, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """seqpar's dense tensors from a Hugging Face state dict ``sd``, fused ones concatenated."""
    state = {}
    for ours, parts in names.items():
        tensors = [sd[theirs] for theirs, _, _ in parts]
        state[ours] = torch.cat(tensors) if len(tensors) > 1 else tensors[0].clone()
    return state


def to_hf(config: GPTConfig, dense_state_dict: dict[str, torch.Tensor], **hf_kwargs):
    """A ``transformers.LlamaForCausalLM`` holding ``dense_state_dict`` (as from
    :meth:`GPT.dense_state_dict` or :func:`from_hf`). ``hf_kwargs`` go to ``LlamaConfig``
    (e.g. ``attn_implementation="eager"``)."""
    from transformers import LlamaForCausalLM

    names = hf_names(config)  # after hf_config's checks
    model = LlamaForCausalLM(hf_config(config, **hf_kwargs)).to(config.torch_dtype)
    missing, unexpected = sorted(set(names) - set(dense_state_dict)), sorted(set(dense_state_dict) - set(names))
    if missing or unexpected:
        raise ValueError(f"to_hf: dense state dict mismatch: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for theirs, w in hf_tensors(config, dense_state_dict.__getitem__):
            if w.shape != params[theirs].shape:
                raise ValueError(f"to_hf: {theirs} would get shape {tuple(w.shape)}, expected "
                                 f"{tuple(params[theirs].shape)}")
            params[theirs].copy_(w)
    return model


__all__ = ["from_hf", "to_hf", "hf_config", "hf_names", "hf_tensors", "check_llama", "config_from_hf", "gather_state",
           "hf_state"]

"""Hugging Face GPT-2 <-> seqpar GPT, through seqpar's layout-invariant dense state dict.

``from_hf`` reads a ``GPT2LMHeadModel`` (or ``GPT2Model``) into a :class:`GPTConfig` and the
full tensors :meth:`GPT.load_dense_state_dict` slices for any TP size; ``to_hf`` builds the
``GPT2LMHeadModel`` back from them. GPT-2's ``Conv1D`` stores weights ``[in, out]``; seqpar's
dense layout is ``nn.Linear``'s ``[out, in]`` (the fused ``c_attn`` columns ``[q | k | v]``
become the ``[q; k; v]`` rows of ``attn.qkv``), so every projection is transposed on the way.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UserError
from ..model.config import DTYPES, GPTConfig
from ..dropin.wrappers import unwrap

# seqpar dense name -> (GPT-2 name, transposed); {i} is the layer index
_LAYER = {
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True), "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True), "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}
_TOP = {"wte.weight": "wte.weight", "wpe.weight": "wpe.weight", "ln_f.weight": "ln_f.weight",
        "ln_f.bias": "ln_f.bias"}
_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _names(layers: int, tied: bool) -> dict[str, tuple[str, bool]]:
    """seqpar dense name -> (name inside ``GPT2LMHeadModel``, transposed)."""
    out = {k: (f"transformer.{v}", False) for k, v in _TOP.items()}
    for i in range(layers):
        out.update({f"blocks.{i}.{k}": (f"transformer.h.{i}.{v}", tr) for k, (v, tr) in _LAYER.items()})
    if not tied:
        out["lm_head.weight"] = ("lm_head.weight", False)
    return out


def from_hf(hf_model: nn.Module, **overrides) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(GPTConfig, dense_state_dict)`` of a ``transformers`` GPT-2 model (compiled or DDP-wrapped
    ones too). The whole architecture is carried: sizes, positions, dropouts, LayerNorm eps,
    activation, tying, init std and dtype; a GPT-2 option seqpar's GPT cannot express raises
    ``ValueError``. ``overrides`` set other
    :class:`GPTConfig` fields (``sequence_parallel``, ``recompute``, ...). Load the result with
    ``GPT(config, mesh).load_dense_state_dict(state)`` at any TP size that divides the vocabulary
    (50257 for the released checkpoints: divisible by no t > 1), heads and widths."""
    hf_model = unwrap(hf_model)  # keys without torch.compile's / DDP's prefixes
    c = hf_model.config
    unsupported = [n for n in ("add_cross_attention", "scale_attn_by_inverse_layer_idx") if getattr(c, n, False)]
    if not getattr(c, "scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False")
    if c.embd_pdrop != c.resid_pdrop:  # seqpar's GPT has one dropout for both
        unsupported.append(f"embd_pdrop={c.embd_pdrop} != resid_pdrop={c.resid_pdrop}")
    if c.activation_function not in _ACT:
        unsupported.append(f"activation_function={c.activation_function!r}")
    if unsupported:
        raise UserError(f"from_hf: seqpar's GPT has no equivalent of GPT-2 option(s) {unsupported}")
    sd = hf_model.state_dict()
    if not any(k.startswith("transformer.") for k in sd):  # a bare GPT2Model
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    tied = bool(getattr(c, "tie_word_embeddings", True)) or "lm_head.weight" not in sd
    dtype = next(name for name, d in DTYPES.items() if d == sd["transformer.wte.weight"].dtype)
    fields = dict(vocab_size=c.vocab_size, seq_len=c.n_positions, hidden=c.n_embd, heads=c.n_head, layers=c.n_layer,
                  ffn_hidden=c.n_inner or 4 * c.n_embd, dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
                  activation=_ACT[c.activation_function], tie_embeddings=tied, layernorm_eps=c.layer_norm_epsilon,
                  bias=True, init_std=c.initializer_range, dtype=dtype)
    fields.update(overrides)
    config = GPTConfig(**fields)
    config.validate()
    state = {}
    for ours, (theirs, transposed) in _names(c.n_layer, tied).items():
        w = sd[theirs].detach()
        state[ours] = (w.t() if transposed else w).contiguous().clone()
    return config, state


def to_hf(config: GPTConfig, dense_state_dict: dict[str, torch.Tensor], **hf_kwargs):
    """A ``transformers.GPT2LMHeadModel`` holding ``dense_state_dict`` (as from
    :meth:`GPT.dense_state_dict` or :func:`from_hf`). ``hf_kwargs`` go to ``GPT2Config``
    (e.g. ``attn_implementation="eager"``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config.validate()
    if not config.bias:
        raise ValueError("to_hf: GPT-2 has biases in every linear layer; config.bias is False")
    names = _names(config.layers, config.tie_embeddings)
    missing, unexpected = sorted(set(names) - set(dense_state_dict)), sorted(set(dense_state_dict) - set(names))
    if missing or unexpected:
        raise ValueError(f"to_hf: dense state dict mismatch: missing {missing}, unexpected {unexpected}")
    hf_config = GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.hidden, n_layer=config.layers,
        n_head=config.heads, n_inner=config.ffn_hidden, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
        attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_eps,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
        initializer_range=config.init_std, tie_word_embeddings=config.tie_embeddings, **hf_kwargs)
    model = GPT2LMHeadModel(hf_config).to(config.torch_dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for ours, (theirs, transposed) in names.items():
            w = dense_state_dict[ours].t() if transposed else dense_state_dict[ours]
            if w.shape != params[theirs].shape:
                raise ValueError(f"to_hf: {ours} has shape {tuple(dense_state_dict[ours].shape)}, expected "
                                 f"{tuple(params[theirs].shape[::-1] if transposed else params[theirs].shape)}")
            params[theirs].copy_(w)
    return model


__all__ = ["from_hf", "to_hf"]

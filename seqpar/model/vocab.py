"""Vocabulary padding: any vocabulary size at any TP size.

The embedding table and the output layer hold ``v_pad = config.padded_vocab(t)`` rows (``v``
rounded up to a multiple of ``vocab_multiple x t``), so every rank holds ``v_pad / t`` of them.
The padded rows are initialised to zero, never looked up (token ids are ``< v``), and their
logits are masked to -inf (in the cross-entropy and in the logits the model returns), so they
get no gradient and the loss and samples are exactly those of the unpadded model. Dense state
dicts, checkpoints and exports carry the true ``v`` rows: :func:`trim_rows` and :func:`pad_rows`
convert at the boundary.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from .. import sharding

VOCAB_PARAMS = ("wte.weight", "lm_head.weight")  # dense names with one row per vocabulary entry


def padded_normal_init(vocab: int, std: float) -> Callable[[torch.Tensor], None]:
    """An init for a ``[v_pad, h]`` master table: ``N(0, std)`` for the first ``vocab`` rows (the
    same draws as an unpadded ``[vocab, h]`` table), zeros for the padding."""
    def init(w: torch.Tensor) -> None:
        nn.init.normal_(w[:vocab], 0.0, std)
        w[vocab:].zero_()
    return init


def trim_rows(dense: Mapping[str, torch.Tensor], vocab: int, names: Iterable[str] = VOCAB_PARAMS) -> dict:
    """``dense`` with the vocabulary tables cut to their first ``vocab`` rows (views)."""
    out = dict(dense)
    for name in names:
        if name in out:
            out[name] = out[name].narrow(0, 0, vocab)
    return out


def true_dense_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Parameter name -> dense shape of a seqpar ``GPT`` or one pipeline stage of it (its
    ``tp_group`` and ``config``), the vocabulary tables with their true ``vocab_size`` rows."""
    v = module.config.vocab_size
    return {k: torch.Size((v, *s[1:])) if k in VOCAB_PARAMS else s
            for k, s in sharding.dense_shapes(module, module.tp_group).items()}


def pad_rows(dense: Mapping[str, torch.Tensor], padded: int, names: Iterable[str] = VOCAB_PARAMS) -> dict:
    """``dense`` with the vocabulary tables zero-padded to ``padded`` rows."""
    out = dict(dense)
    for name in names:
        if name in out and out[name].shape[0] < padded:
            w = out[name]
            out[name] = torch.cat([w, w.new_zeros((padded - w.shape[0], *w.shape[1:]))])
    return out


def check_token_ids(tokens: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` unless every id of ``tokens`` lies in ``[0, vocab)``: the padded rows
    must never be looked up. Checked on CPU only (on CUDA it would be a host sync per batch; the
    data is range-checked when opened), nor while compiling."""
    if tokens.device.type != "cpu" or not tokens.numel() or torch.compiler.is_compiling():
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) (vocab_size), got min {low} max {high}")


def mask_padded_logits(logits: torch.Tensor, vocab: int, vocab_start: int) -> torch.Tensor:
    """This rank's logits ``[..., v_pad/t]`` (columns from ``vocab_start``) with the columns at or
    past ``vocab`` set to -inf; returned as is when the rank holds no padding."""
    valid = min(max(vocab - vocab_start, 0), logits.shape[-1])
    if valid == logits.shape[-1]:
        return logits
    keep = torch.arange(logits.shape[-1], device=logits.device) < valid
    return logits.masked_fill(~keep, float("-inf"))

"""What every benchmarked system provides: build a GPT shape, take a training step, report what
it keeps for backward. All peers build the same architecture (GPT-2 style, pre-LN, learned
positions, tied embeddings, GeLU MLP of 4h, biases) and load the same dense weights where they can,
so their step-0 losses agree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...model.modes import RecomputeMode as Recompute


@dataclass(frozen=True)
class BenchShape:
    vocab_size: int = 1024
    seq_len: int = 256
    hidden: int = 256
    heads: int = 8
    layers: int = 2
    micro_batch: int = 2
    dtype: str = "float32"     # parameter dtype of every system (CPU benches run fp32)
    dropout: float = 0.0       # every dropout (embedding, attention probabilities, residual) of every system

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.hidden


def copy_dense(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module``'s parameters, name for name and shape for shape: a
    ``ValueError`` names every missing or unexpected name, or the first shape that differs."""
    own = dict(module.named_parameters())  # a tied parameter appears once, under its first name
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"dense state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in own.items():
            if p.shape != state[name].shape:
                raise ValueError(f"{name}: dense shape {tuple(state[name].shape)} != {tuple(p.shape)}")
            p.copy_(state[name])


class Peer(Protocol):
    name: str

    def build(self, shape: BenchShape, dense_state: dict[str, torch.Tensor], *, tp_group, tp_rank: int,
              tp_size: int, recompute: Recompute, sequence_parallel: bool = True) -> None:
        """Create the model from ``dense_state`` (seqpar's dense names, see ``GPT.dense_state_dict``)
        and an optimizer (AdamW, lr 1e-4, no weight decay). Called on every TP rank."""

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """One forward + backward + optimizer step on ``[b, s]`` tokens; returns the mean loss
        (identical on all TP ranks). Includes whatever grad sync the system needs."""

    def saved_bytes_per_layer(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean bytes kept for backward per transformer layer in one forward (storages counted once,
        parameters and buffers excluded; see ``seqpar.memory.ActivationLedger`` with a
        ``layer_pattern`` matching this system's layer module names)."""

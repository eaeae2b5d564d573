"""Seeded training batches and fixed eval batches, cut from one global batch per step.

The windows optimizer step ``s`` trains on depend only on the seed, ``s`` and the global batch
size ``G = micro_batch x accum x dp_size``: the step draws ``G`` window starts from
``Generator(PCG64([seed, s]))`` and cuts them, in order, into micro-batch ``m`` of DP rank ``r``,
starts ``[(m * dp_size + r) * micro_batch, ... + micro_batch)``. Every split of one global batch
into micro-batches, accumulation steps and DP ranks therefore trains on the same windows (the
step's mean loss and gradient are the same), TP ranks of one DP rank get identical batches, and
resuming needs nothing but the step.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import DataError

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), int64 [micro_batch, seq_len]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    x = torch.from_numpy(rows)  # [b, s + 1]
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _check_split(tokens: np.ndarray, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int, accum: int,
                 what: str) -> None:
    if seq_len < 1 or micro_batch < 1 or accum < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{what}: need seq_len >= 1, micro_batch >= 1, accum >= 1, 0 <= dp_rank < dp_size; got "
                         f"seq_len={seq_len} micro_batch={micro_batch} accum={accum} dp_rank={dp_rank} "
                         f"dp_size={dp_size}")
    if len(tokens) < seq_len + 1:
        raise DataError(f"{what}: {len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}")


def _slice(micro: int, dp_rank: int, dp_size: int, micro_batch: int) -> slice:
    """Where micro-batch ``micro`` of DP rank ``dp_rank`` sits in its global batch."""
    lo = (micro * dp_size + dp_rank) * micro_batch
    return slice(lo, lo + micro_batch)


class TokenBatches:
    """Random ``seq_len + 1`` windows of ``tokens`` as ``(inputs, labels)`` int64 ``[micro_batch, seq_len]``:
    the ``accum`` micro-batches of this DP rank at each optimizer step (see the module docstring).

    Iterating yields one step's list of micro-batches after another; :meth:`state_dict` records the
    next step, so resuming continues the same sequence of batches.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, accum: int = 1):
        _check_split(tokens, seq_len, micro_batch, dp_rank, dp_size, accum, "TokenBatches")
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.seed, self.dp_rank, self.dp_size, self.accum = seed, dp_rank, dp_size, accum
        self.step = 0

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all DP ranks and micro-batches."""
        return self.micro_batch * self.accum * self.dp_size

    def starts(self, step: int, micro: int = 0) -> np.ndarray:
        """Window starts of micro-batch ``micro`` of this DP rank at optimizer step ``step``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        everyone = rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)
        return everyone[_slice(micro, self.dp_rank, self.dp_size, self.micro_batch)]

    def batch(self, step: int, micro: int = 0) -> Batch:
        """Micro-batch ``micro`` (of ``accum``) of this DP rank at optimizer step ``step``."""
        if not 0 <= micro < self.accum:
            raise ValueError(f"TokenBatches.batch: micro must lie in [0, {self.accum}), got {micro}")
        return _windows(self.tokens, self.starts(step, micro), self.seq_len)

    def step_batches(self, step: int) -> list[Batch]:
        """The ``accum`` micro-batches of this DP rank at optimizer step ``step``."""
        return [self.batch(step, m) for m in range(self.accum)]

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> list[Batch]:
        out = self.step_batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise DataError(f"train.seed={self.seed} differs from the checkpoint's train.seed={state.get('seed')!r}, "
                            f"which fixes the order of its training windows; resume with "
                            f"train.seed={state.get('seed')!r} (or train into a new checkpoint.dir)")
        self.step = int(state["step"])


def eval_batches(tokens: np.ndarray, *, seq_len: int, micro_batch: int, num_batches: int,
                 dp_rank: int = 0, dp_size: int = 1, accum: int = 1) -> list[Batch]:
    """Fixed evaluation micro-batches of this DP rank: ``num_batches`` global batches of
    ``micro_batch x accum x dp_size`` windows spread evenly over ``tokens`` (the held-out split),
    each cut like a training step's. No randomness; the mean over the returned micro-batches
    (all the same size) is the same for every split of the global batch."""
    _check_split(tokens, seq_len, micro_batch, dp_rank, dp_size, accum, "eval_batches")
    if num_batches < 1:
        raise ValueError(f"eval_batches: num_batches must be >= 1, got {num_batches}")
    per_batch = micro_batch * accum * dp_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * per_batch).astype(np.int64)
    return [_windows(tokens, starts[b * per_batch:(b + 1) * per_batch][_slice(m, dp_rank, dp_size, micro_batch)],
                     seq_len)
            for b in range(num_batches) for m in range(accum)]

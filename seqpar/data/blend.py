"""Blends: several sources mixed by weight (``data.sources: [{source, weight}, ...]``).

Which source each sequence of a step comes from depends only on the seed and the sequence's
global index ``i = step x G + j`` (``G`` the global batch): a Weyl sequence ``u_i = frac(c + i /
phi)`` (64-bit integer arithmetic, so exact at any step), cut by the cumulative weights. Any run of
``N`` consecutive sequences holds each source within a few sequences of ``N x weight``, the mix is
the same for every dp size, micro-batch split and restart (it is a function of ``i``), and resuming
needs only the step. Within a step the sources are shuffled and each sequence's window is drawn
uniformly from its source's training split with ``Generator(PCG64([seed, step]))``, then the step
is cut into micro-batches exactly like :class:`~seqpar.data.batches.TokenBatches` does.
"""
from __future__ import annotations

import numpy as np
import torch

from .batches import Batch, TokenBatches, _slice, _windows
from .errors import DataError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / phi, odd
_CHUNK = 1 << 20  # sequences per pass when counting a long mix


class Joined:
    """Id arrays read as one (nothing copied): ``len``, ``dtype`` and contiguous slices, which
    return arrays. What a checkpoint's data identity samples for a blend."""

    ndim = 1

    def __init__(self, parts: list):
        self.parts = parts
        self.bounds = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, step = key.indices(len(self))
        if step != 1:
            raise IndexError("Joined: only contiguous slices")
        pieces = []
        for k, part in enumerate(self.parts):
            lo, hi = max(a, self.bounds[k]), min(b, self.bounds[k + 1])
            if lo < hi:
                pieces.append(np.asarray(part[lo - self.bounds[k]:hi - self.bounds[k]], dtype=self.dtype))
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)


def mix_sources(seed: int, first: int, count: int, cum: np.ndarray) -> np.ndarray:
    """Source index of global sequences ``first .. first + count - 1`` (``cum``: cumulative
    normalised weights, last 1.0)."""
    offset = np.random.Generator(np.random.PCG64([seed, 0xB1E7D])).integers(0, 2**63, dtype=np.uint64)
    i = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = i * _GOLDEN + offset  # wraps modulo 2**64: the fractional part of c + i / phi
    u = (x >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.minimum(np.searchsorted(cum, u, side="right"), len(cum) - 1)


class BlendBatches(TokenBatches):
    """Training windows drawn from several token arrays by weight (see the module docstring);
    the same interface and checkpoint state as :class:`TokenBatches`."""

    def __init__(self, parts: list, weights: list[float], names: list[str], *, seq_len: int, micro_batch: int,
                 seed: int, dp_rank: int = 0, dp_size: int = 1, accum: int = 1):
        for name, part in zip(names, parts):
            if len(part) < seq_len + 1:
                raise DataError(f"data.sources: the training split of {name!r} has {len(part)} tokens, fewer than "
                                f"seq_len + 1 = {seq_len + 1}")
        super().__init__(parts[0], seq_len=seq_len, micro_batch=micro_batch, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size, accum=accum)
        w = np.asarray(weights, dtype=np.float64)
        self.parts, self.names, self.weights = parts, list(names), w / w.sum()
        self.cum = np.cumsum(self.weights)
        self.cum[-1] = 1.0
        self.lengths = np.array([len(p) for p in parts], np.int64)

    def picks(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, window start)`` of each of the ``G`` sequences of optimizer step ``step``."""
        g = self.global_batch
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        src = rng.permutation(mix_sources(self.seed, step * g, g, self.cum))
        starts = (rng.random(g) * (self.lengths[src] - self.seq_len)).astype(np.int64)
        return src, starts

    def batch(self, step: int, micro: int = 0) -> Batch:
        if not 0 <= micro < self.accum:
            raise ValueError(f"BlendBatches.batch: micro must lie in [0, {self.accum}), got {micro}")
        src, starts = self.picks(step)
        mine = _slice(micro, self.dp_rank, self.dp_size, self.micro_batch)
        xs, ys = zip(*(_windows(self.parts[s], np.array([a]), self.seq_len) for s, a in zip(src[mine], starts[mine])))
        return torch.cat(xs), torch.cat(ys)  # [micro_batch, seq_len] each

    def drawn(self, steps: int) -> np.ndarray:
        """Sequences each source gives to optimizer steps ``0 .. steps - 1`` (all ranks together)."""
        counts, total = np.zeros(len(self.parts), np.int64), steps * self.global_batch
        for first in range(0, total, _CHUNK):
            src = mix_sources(self.seed, first, min(_CHUNK, total - first), self.cum)
            counts += np.bincount(src, minlength=len(self.parts))
        return counts

    def mix_line(self, steps: int) -> str:
        """One line: the share of sequences each source gives to ``steps`` steps, next to its weight."""
        counts = self.drawn(steps)
        parts = [f"{name} {c / max(1, counts.sum()):.1%} (weight {w:.1%})"
                 for name, c, w in zip(self.names, counts, self.weights)]
        return f"data: blend over {steps} steps x {self.global_batch} sequences: " + ", ".join(parts)

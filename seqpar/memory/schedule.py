"""Layers in flight: how many layers' worth of one micro-batch's activations a pipeline rank holds
at its peak, for every schedule (§4.2.3).

A rank's peak comes just before its first backward: every forward chunk it started by then is
still held. With ``p`` stages, ``m`` model chunks per rank (``L/(pm)`` layers each) and ``n``
micro-batches per step, rank ``r`` has started

* ``1F1B``: ``min(n, p - r)`` micro-batches of its one chunk (the first stage ``p``: ``L`` layers);
* ``Interleaved1F1B`` (Megatron's and PyTorch's warm-up): ``(m - 1) n_r + 2 (p - 1 - r) + 1``
  chunks, ``n_r = n / max(1, n // p)`` micro-batches per round (``p`` when ``p | n``), at most
  ``n m``; the first stage holds ``L (1 + (p-1)/(pm))``, §4.2.3's factor;
* ``GPipe``: all ``n`` micro-batches before any backward;
* one stage (``p = 1``): one micro-batch of all ``L`` layers.
"""
from __future__ import annotations

from fractions import Fraction

SCHEDULES: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "GPipe")


def chunks_in_flight(schedule: str, *, pp_rank: int, pp: int, virtual_stages: int, n_microbatches: int) -> int:
    """Model chunks (of ``L/(pm)`` layers, one micro-batch each) rank ``pp_rank`` holds at its peak."""
    p, m, n, r = pp, virtual_stages, n_microbatches, pp_rank
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if min(p, m, n) < 1 or not 0 <= r < p:
        raise ValueError(f"need pp, virtual_stages, n_microbatches >= 1 and 0 <= pp_rank < pp; got pp={p}, "
                         f"virtual_stages={m}, n_microbatches={n}, pp_rank={r}")
    if p == 1:
        return m
    if schedule == "GPipe":
        return n * m
    if schedule == "1F1B":
        return min(n, p - r) * m
    per_round = n // max(1, n // p)
    return min((m - 1) * per_round + 2 * (p - 1 - r) + 1, n * m)


def layers_in_flight(schedule: str, *, pp_rank: int, pp: int, virtual_stages: int, layers: int,
                     n_microbatches: int) -> Fraction:
    """Layers' worth of one micro-batch's activations rank ``pp_rank`` holds at its peak: the
    chunks of :func:`chunks_in_flight`, ``L/(pm)`` layers each."""
    chunks = chunks_in_flight(schedule, pp_rank=pp_rank, pp=pp, virtual_stages=virtual_stages,
                              n_microbatches=n_microbatches)
    return Fraction(layers, pp * virtual_stages) * chunks


def in_flight_per_layer(*, pp_rank: int, pp: int, virtual_stages: int, n_microbatches: int) -> Fraction:
    """Micro-batches' worth each layer of rank ``pp_rank`` holds at its peak, under the schedule
    seqpar picks (1F1B, interleaved for ``m > 1``): :func:`layers_in_flight` over the rank's layers."""
    schedule = "1F1B" if virtual_stages == 1 else "Interleaved1F1B"
    chunks = chunks_in_flight(schedule, pp_rank=pp_rank, pp=pp, virtual_stages=virtual_stages,
                              n_microbatches=n_microbatches)
    return Fraction(chunks, virtual_stages)


def first_chunk_in_flight(*, pp: int, virtual_stages: int, n_microbatches: int) -> int:
    """Micro-batches the first stage's first model chunk (the one with the embedding) holds at the
    stage's peak, under the schedule seqpar picks: ``min(n, p)`` for 1F1B; interleaved, the forward
    chunks run in rounds of ``n_r`` micro-batches per chunk, so of the :func:`chunks_in_flight`
    ``c`` the first chunk has ``n_r`` per full cycle of ``m n_r`` and up to ``n_r`` of the rest."""
    if virtual_stages == 1 or pp == 1:
        return min(n_microbatches, pp)
    chunks = chunks_in_flight("Interleaved1F1B", pp_rank=0, pp=pp, virtual_stages=virtual_stages,
                              n_microbatches=n_microbatches)
    per_round = n_microbatches // max(1, n_microbatches // pp)
    cycles, rest = divmod(chunks, virtual_stages * per_round)
    return cycles * per_round + min(rest, per_round)


def interleave_factor(p: int, m: int = 1) -> Fraction:
    """The first stage's layers in flight in units of ``L`` once the pipeline is full:
    ``1 + (p-1)/(pm)`` (§4.2.3); ``m == 1`` (plain 1F1B) gives 1."""
    if p < 1 or m < 1:
        raise ValueError(f"pipeline size p and chunks m must be >= 1, got p={p}, m={m}")
    return in_flight_per_layer(pp_rank=0, pp=p, virtual_stages=m, n_microbatches=2 * p) / p if p > 1 else Fraction(1)


__all__ = ["SCHEDULES", "chunks_in_flight", "first_chunk_in_flight", "in_flight_per_layer", "interleave_factor",
           "layers_in_flight"]

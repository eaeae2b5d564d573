"""Communication of one transformer layer (§4.2.2), in bytes: the paper's volume and seqpar's calls.

Per layer and micro-batch, forward and backward, every tensor-parallel collective operates on one
``[s, b, h]`` activation of ``n = s b h`` elements (its full size: an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor). The paper:

* tensor parallelism (TP): f / f-bar around attention and MLP: 4 all-reduces of ``n``;
* sequence parallelism (SP): g / g-bar instead: 4 all-gathers + 4 reduce-scatters of ``n``, the
  same bytes on the wire (a ring all-reduce is a reduce-scatter then an all-gather).

seqpar's layers add, under SP, the backward re-gather of the two column layers' saved input
shards (2 all-gathers, overlapped with the input-gradient GEMMs); full recomputation repeats the
forward's collectives (2 all-reduces, or 2 all-gathers + 2 reduce-scatters). Selective
recomputation adds none. Ring algorithms send ``(t-1)/t`` of an all-gather's or a reduce-scatter's
``n`` per rank and ``2(t-1)/t`` of an all-reduce's.
"""
from __future__ import annotations

from fractions import Fraction

WIRE_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # x (t-1)/t of the full tensor


def wire_bytes(kind: str, nbytes: float, t: int) -> float:
    """Bytes one rank sends for a ring collective of ``kind`` on a full tensor of ``nbytes``."""
    return float(WIRE_FACTOR[kind] * Fraction(t - 1, t) * Fraction(nbytes))


def paper_layer_comm(*, s: int, b: int, h: int, t: int, act: int,
                     sequence_parallel: bool) -> dict[str, tuple[int, int]]:
    """§4.2.2's collectives of one layer for one micro-batch, forward and backward: ``kind ->
    (calls, bytes of the full tensors)`` at ``act``-byte activations (nothing at ``t = 1``)."""
    if t == 1:
        return {}
    n = s * b * h * act
    if sequence_parallel:
        return {"all_gather": (4, 4 * n), "reduce_scatter": (4, 4 * n)}
    return {"all_reduce": (4, 4 * n)}


def layer_comm(*, s: int, b: int, h: int, t: int, act: int, sequence_parallel: bool,
               recompute: str = "selective") -> dict[str, tuple[int, int]]:
    """The collectives seqpar's layer issues (module docstring): the paper's, plus SP's two
    backward re-gathers, plus the forward's again under full recompute."""
    calls = {k: c for k, (c, _) in paper_layer_comm(s=s, b=b, h=h, t=t, act=act,
                                                    sequence_parallel=sequence_parallel).items()}
    if sequence_parallel and calls:
        calls["all_gather"] += 2
    if recompute == "full":
        for kind in calls:
            calls[kind] += 2
    n = s * b * h * act
    return {kind: (c, c * n) for kind, c in calls.items()}


def layer_wire_bytes(comm: dict[str, tuple[int, int]], t: int) -> float:
    """Bytes one rank sends for ``comm`` (as :func:`layer_comm` returns it) with ring algorithms."""
    return sum(wire_bytes(kind, nbytes, t) for kind, (_, nbytes) in comm.items())


__all__ = ["WIRE_FACTOR", "layer_comm", "layer_wire_bytes", "paper_layer_comm", "wire_bytes"]

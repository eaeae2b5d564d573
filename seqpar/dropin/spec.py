"""What a plan asks for (:class:`Style`, :class:`Plan`) and what :func:`~seqpar.parallelize` did
(:class:`Parallelized`, kept on the model as ``model.seqpar``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..distributed.collectives import ProcessGroup
from ..distributed.rng import RNGStreams

Kind = Literal["column", "row", "vocab", "sequence", "enter_tp"]
KINDS: tuple[str, ...] = get_args(Kind)
SPLIT = ("column", "row", "vocab")  # the kinds that swap a module for a seqpar layer


@dataclass(frozen=True)
class Style:
    """How one module is parallelised.

    ``column``: output features split over TP (``[b, s/t, in]`` SP shard or ``[b, s, in]`` in,
    ``[b, s, out/t]`` out). ``row``: input features split; output all-reduced, or reduce-scattered
    to ``[b, s/t, out]`` under SP. ``vocab``: an ``nn.Embedding`` split by vocabulary rows (output
    all-reduced to ``[b, s, h]``), or an output head split by vocabulary whose logits are
    all-gathered to ``[b, s, v]`` for the model's own loss. ``sequence``: runs on sequence shards
    under SP (norms): its parameters are SP-replicated, gradients summed over TP in backward; an
    ``nn.Dropout`` draws from the per-TP-rank stream under SP, the replicated one without.
    ``enter_tp``: a module that needs its full-sequence input (one that reshapes by its input's
    shape, like Llama's attention): its hidden states are all-gathered once on entry (g; f without
    SP) and the column layers inside skip their own input communication, so their partial input
    gradients are summed by a single reduce-scatter (all-reduce). Costs the full ``[b, s, h]``
    input kept for the weight gradients instead of the shard.
    """

    kind: Kind
    chunks: int = 1  # column only: the output is `chunks` equal blocks split separately (fused [q; k; v]: 3)


@dataclass(frozen=True)
class KVHeads:
    """Grouped-query attention's key/value heads, which may be fewer than ``t``.

    ``config``: the ``model.config`` attribute holding their number ``g``. ``layers``: patterns of
    the column layers holding them, split by whole heads: over ``t`` ranks when ``t`` divides
    ``g``, else (``t`` a multiple of ``g``) each head held by the ``t/g`` consecutive ranks whose
    query heads use it, its gradient summed over them in backward. Per module pattern, int
    attributes set where present: ``heads`` count this rank's key/value heads (``g/t``, or 1),
    ``groups`` its query heads per key/value head (unchanged, or divided by ``t/g``)."""

    config: str
    layers: tuple[str, ...]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def parts(self, g: int, t: int) -> int:
        """How many distinct pieces the heads are split into (``t``, or ``g`` when ``t > g``)."""
        return t if g % t == 0 else g


@dataclass(frozen=True, eq=False)
class Plan:
    """Which modules become what. Patterns are dotted module names where ``*`` matches one name
    component (``transformer.h.*.attn.c_attn``); every pattern must match at least one module.

    ``seq_dim`` is the sequence dim of the hidden states between ``sp_start`` and ``sp_end``:
    1 for batch-first ``[b, s, h]`` models (Hugging Face; the ready plans say so), 0 for
    sequence-first ``[s, b, h]`` ones (seqpar's layers' default). Sequence parallelism needs it
    stated: there is no default, because the wrong one silently splits the batch instead."""

    layers: dict[str, str | Style]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # int attributes divided by t where present
    divisible: tuple[str, ...] = ()  # model.config attributes t must divide (head counts)
    sp_start: str | None = None      # its input hidden states are scattered into sequence shards
    sp_end: str | None = None        # its output is all-gathered back to full sequences
    seq_dim: int | None = None       # sequence dim of the hidden states (1: [b, s, h]); required for SP
    kv: KVHeads | None = None        # key/value heads that may be fewer than t (grouped-query attention)


@dataclass
class Parallelized:
    """What :func:`~seqpar.parallelize` did, kept on the model as ``model.seqpar``."""

    tp_group: ProcessGroup | None
    tp_size: int
    sequence_parallel: bool                 # the current mode (see ``set_sequence_parallel``)
    swapped: dict[str, tuple[Style, bool]]  # module name -> (style, was a transposed Conv1D)
    plan: Plan | None = None
    resolved: dict[str, Style] = field(default_factory=dict)  # every module the plan names -> its style
    handles: list = field(default_factory=list)       # region-boundary forward hooks
    grad_handles: list = field(default_factory=list)  # TP-sum hooks of the SP-replicated gradients
    streams: RNGStreams | None = None  # dropout streams (seqpar.dropin.dropout): "tp" per rank, "replicated"


__all__ = ["Kind", "KINDS", "SPLIT", "Style", "KVHeads", "Plan", "Parallelized"]

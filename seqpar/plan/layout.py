"""A layout: how one model is laid out on a cluster (t, p, m, dp, cp, ep, micro-batch, SP, recompute).

Recompute is either uniform (``none``, ``selective`` or ``full`` with its method and N, as
``model.recompute`` takes it) or ``mixed``: a count of layers per mode for every pipeline stage
(the same on each stage; see :mod:`seqpar.plan.recompute`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ..distributed.context import check_context_layout
from ..errors import UserError
from ..model.config import GPTConfig
from ..model.modes import (DATA_PARALLEL_MODES, RECOMPUTE_METHODS, RECOMPUTE_MODES, DataParallelMode, RecomputeMethod,
                           RecomputeMode)

Mode = RecomputeMode  # the planner's name for one layer's recompute mode


@dataclass(frozen=True)
class Recompute:
    """What each layer recomputes. ``counts`` (mixed only): layers per mode on every stage."""

    kind: Literal[RecomputeMode, "mixed"] = "selective"
    method: RecomputeMethod = "uniform"        # full only, as GPTConfig.recompute_method
    num_layers: int = 1                        # full only: N, as GPTConfig.recompute_num_layers
    counts: tuple[tuple[Mode, int], ...] = ()  # mixed only, e.g. (("none", 29), ("selective", 19))
    ops: tuple[str, ...] = ()                  # model.recompute_ops of the none / selective layers

    def per_stage(self, chunk: int, chunks: int = 1) -> dict[Mode, int]:
        """Layers of each mode on a stage of ``chunks`` model chunks of ``chunk`` layers each
        (``full`` block N: the first N layers of every chunk are full, the rest keep everything)."""
        n = chunk * chunks
        if self.kind == "mixed":
            out = {m: 0 for m in RECOMPUTE_MODES}
            out.update(dict(self.counts))
            if sum(out.values()) != n:
                raise ValueError(f"mixed recompute counts {dict(self.counts)} do not add up to {n} layers per stage")
            return out
        if self.kind == "full" and self.method == "block":
            k = min(self.num_layers, chunk)
            return {"none": (chunk - k) * chunks, "selective": 0, "full": k * chunks}
        return {m: (n if m == self.kind else 0) for m in RECOMPUTE_MODES}

    def label(self) -> str:
        return self._kind_label() + "".join(f"+{op}" for op in self.ops)

    def _kind_label(self) -> str:
        if self.kind == "mixed":
            return "mix(" + ",".join(f"{m[:4]}={k}" for m, k in self.counts if k) + ")"
        if self.kind == "full":
            return f"full/{self.method}/{self.num_layers}"
        return self.kind


@dataclass(frozen=True)
class Layout:
    """One point of the search: sizes of the parallel dimensions and the per-layer settings."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int = 1      # m, interleaved chunks per stage
    micro_batch: int = 1
    sequence_parallel: bool = True
    recompute: Recompute = Recompute()
    data_parallel: DataParallelMode = "ddp"
    cp: int = 1                  # context parallelism: each sequence over cp ranks (s/cp each)
    ep: int = 1                  # expert parallelism (MoE only): each MoE layer's experts over ep of the dp x cp ranks

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: those of dp x cp holding the same experts (dp x cp / ep)."""
        return self.dp * self.cp // self.ep

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def cp_comm(self) -> str:
        """How the CP ranks exchange K/V: the ring (its steps overlap the attention) without pipeline
        stages, the all-gather with them (``seqpar train`` refuses the ring with pp > 1)."""
        return "ring" if self.pp == 1 else "allgather"

    def label(self) -> str:
        fsdp = self.data_parallel == "fsdp" and self.dp * self.cp > 1  # FSDP2 shards over dp x cp
        dp = f"dp={self.dp}" + ("(fsdp)" if fsdp else "")
        dp += f" cp={self.cp}" if self.cp > 1 else ""
        dp += f" ep={self.ep}" if self.ep > 1 else ""
        return (f"t={self.tp} p={self.pp} m={self.virtual_stages} {dp} b={self.micro_batch} "
                f"sp={'on' if self.sequence_parallel else 'off'} rc={self.recompute.label()}")


def micro_batches(layout: Layout, global_batch: int) -> int:
    """Micro-batches each pipeline runs per step, ``global_batch / (dp * micro_batch)``."""
    per = layout.dp * layout.micro_batch
    if global_batch % per:
        raise UserError(f"global batch {global_batch} is not a multiple of dp x micro_batch = "
                        f"{layout.dp} x {layout.micro_batch} = {per}")
    return global_batch // per


def check_layout(layout: Layout, model: GPTConfig, gpus: int, global_batch: int, gpus_per_node: int) -> None:
    """Raise :class:`~seqpar.errors.UserError` naming the offending values if ``layout`` cannot
    run ``model``."""
    problems = _context_problems(layout, model) + _expert_problems(layout, model)
    if layout.gpus != gpus:
        cp = f" x cp={layout.cp}" if layout.cp > 1 else ""
        problems.append(f"tp x pp x dp{cp} = {layout.tp} x {layout.pp} x {layout.dp}{cp} = {layout.gpus} != --gpus {gpus}")
    if layout.tp > gpus_per_node or gpus_per_node % layout.tp:
        problems.append(f"tp={layout.tp} must divide --gpus-per-node {gpus_per_node} (TP stays inside a node)")
    chunks = layout.pp * layout.virtual_stages
    if model.layers % chunks:
        problems.append(f"layers {model.layers} not divisible by pp x virtual_stages = {chunks}")
    if layout.virtual_stages > 1 and layout.pp == 1:
        problems.append(f"virtual_stages={layout.virtual_stages} needs pp > 1")
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence_parallel needs tp > 1")
    if layout.data_parallel == "fsdp" and layout.dp * layout.cp == 1:
        problems.append("data_parallel=fsdp needs dp x cp > 1")
    if layout.data_parallel == "fsdp" and layout.pp > 1:  # as the run config refuses it (seqpar.config.schema)
        problems.append(f"data_parallel=fsdp with pp={layout.pp}: pipeline stages reduce their gradients over dp "
                        f"themselves (ddp)")
    try:
        n = micro_batches(layout, global_batch)
        if layout.virtual_stages > 1 and n % layout.pp:
            problems.append(f"the interleaved schedule needs micro-batches per step ({n}) divisible by pp={layout.pp}")
    except UserError as err:
        problems.append(str(err))
    try:
        replace(model, sequence_parallel=layout.sequence_parallel).check_parallel(layout.tp)
    except UserError as err:
        problems.append(str(err))
    if layout.recompute.kind == "full" and layout.recompute.num_layers > model.layers // chunks:
        problems.append(f"recompute_num_layers={layout.recompute.num_layers} exceeds the "
                        f"{model.layers // chunks} layers of a model chunk")
    if problems:
        raise UserError(f"layout {layout.label()}: " + "; ".join(problems))


def _context_problems(layout: Layout, model: GPTConfig) -> list[str]:
    """What context parallelism refuses, as the run config does (:mod:`seqpar.config.schema`)."""
    if layout.cp == 1:
        return []
    problems = []
    try:
        check_context_layout(model.seq_len, layout.cp, layout.tp, layout.sequence_parallel)
    except UserError as err:
        problems.append(str(err))
    if model.attention_dropout > 0:
        problems.append(f"cp={layout.cp} needs attention_dropout 0 (got {model.attention_dropout})")
    return problems


def _expert_problems(layout: Layout, model: GPTConfig) -> list[str]:
    """What expert parallelism refuses, as the run config does (:mod:`seqpar.config.schema`)."""
    if layout.ep == 1:
        return []
    if model.moe is None:
        return [f"ep={layout.ep} splits experts, but the model has none (model.moe is not set)"]
    problems = []
    if model.moe.experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide the {model.moe.experts} experts of model.moe.experts")
    if (layout.dp * layout.cp) % layout.ep:
        problems.append(f"ep={layout.ep} does not divide dp x cp = {layout.dp} x {layout.cp} = {layout.dp * layout.cp}")
    if layout.pp > 1:
        problems.append(f"ep={layout.ep} with pp={layout.pp} is not planned yet (seqpar train runs it; the "
                        f"planner prices expert parallelism without pipeline stages only)")
    return problems


def run_layout(model: GPTConfig, *, tp: int, pp: int, dp: int, virtual_stages: int, micro_batch: int,
               data_parallel: DataParallelMode, cp: int = 1, stage_layers: list[int] | None = None,
               ep: int = 1) -> Layout:
    """The layout a resolved run trains with (``stage_layers``: the layers of the stage whose
    per-layer recompute modes count, when ``model.recompute_layers`` is set)."""
    modes = model.recompute_layers
    if modes is not None:
        mine = [modes[i] for i in (stage_layers if stage_layers is not None else range(len(modes)))]
        recompute = Recompute("mixed", counts=tuple((m, mine.count(m)) for m in RECOMPUTE_MODES))
    else:
        recompute = Recompute(model.recompute, model.recompute_method, model.recompute_num_layers)
    return Layout(tp, pp, dp, virtual_stages, micro_batch, model.sequence_parallel and tp > 1, recompute,
                  data_parallel if dp > 1 else "ddp", cp, ep)


_KEYS = {"tp": int, "cp": int, "ep": int, "pp": int, "dp": int, "virtual_stages": int, "micro_batch": int,
         "sequence_parallel": bool,
         "recompute": str, "recompute_method": str, "recompute_num_layers": int, "data_parallel": str}


def _value(key: str, raw: str):
    kind = _KEYS[key]
    if kind is bool:
        if raw.lower() not in ("true", "false"):
            raise UserError(f"--layout {key}={raw!r}: expected true or false")
        return raw.lower() == "true"
    if kind is int:
        try:
            value = int(raw)
        except ValueError:
            raise UserError(f"--layout {key}={raw!r}: expected a positive integer") from None
        if value < 1:
            raise UserError(f"--layout {key}={raw!r}: expected a positive integer")
        return value
    return raw


def parse_layout(text: str, gpus: int) -> Layout:
    """``tp=8,pp=8,virtual_stages=3,micro_batch=1,sequence_parallel=true,recompute=selective`` -> Layout.

    ``dp`` defaults to ``gpus / (tp * pp)``; recompute is ``none|selective|full``, with
    ``recompute_method`` and ``recompute_num_layers`` for full; ``data_parallel`` is ``ddp|fsdp``;
    ``ep`` (MoE models) splits the experts over that many of the dp x cp ranks.
    """
    values: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in _KEYS:
            raise UserError(f"--layout item {item!r}: expected key=value with key one of {sorted(_KEYS)}")
        values[key] = _value(key, raw.strip())
    tp, pp, cp = values.get("tp", 1), values.get("pp", 1), values.get("cp", 1)
    if gpus % (tp * pp * cp):
        what = f"tp={tp} pp={pp}: tp x pp = {tp * pp}" if cp == 1 else f"tp={tp} pp={pp} cp={cp}: tp x pp x cp = " \
               f"{tp * pp * cp}"
        raise UserError(f"--layout {what} does not divide --gpus {gpus}")
    kind = values.get("recompute", "selective")
    if kind not in RECOMPUTE_MODES:
        raise UserError(f"--layout recompute={kind!r}: expected one of {list(RECOMPUTE_MODES)}")
    method = values.get("recompute_method", "uniform")
    if method not in RECOMPUTE_METHODS:
        raise UserError(f"--layout recompute_method={method!r}: expected one of {list(RECOMPUTE_METHODS)}")
    dpm = values.get("data_parallel", "ddp")
    if dpm not in DATA_PARALLEL_MODES:
        raise UserError(f"--layout data_parallel={dpm!r}: expected one of {list(DATA_PARALLEL_MODES)}")
    return Layout(tp=tp, pp=pp, dp=values.get("dp", gpus // (tp * pp * cp)), cp=cp, ep=values.get("ep", 1),
                  virtual_stages=values.get("virtual_stages", 1), micro_batch=values.get("micro_batch", 1),
                  sequence_parallel=values.get("sequence_parallel", tp > 1),
                  recompute=Recompute(kind, method, values.get("recompute_num_layers", 1)), data_parallel=dpm)

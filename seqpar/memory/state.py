"""Training-state bytes per rank: parameters, gradients and AdamW state, for every precision and
data-parallel mode. The planner (:mod:`seqpar.plan.memory`) and ``seqpar memory --dp`` both read
them from here.

What a rank holds, per parameter of its TP shard (``N_t``, :mod:`seqpar.memory.params`), with
``w`` the parameters' bytes (``model.dtype``; 4 for the fp32 masters every bf16 mode needs):

* kept across steps: parameters ``w``, gradients ``w`` (``.grad``; the bf16 recipe accumulates
  into fp32), AdamW ``2w`` (``exp_avg``, ``exp_avg_sq``); ``fsdp`` with ``dp > 1`` divides all
  three by ``dp`` (FSDP2 keeps one dim-0 slice of each tensor per dp rank), ``ddp`` replicates them;
* during a step only, under ``ddp``: the bf16 recipe's compute copies of all parameters (2 bytes,
  made once per optimizer step, :class:`seqpar.train.precision.Precision`) and their bf16 gradients
  (2 bytes, until added into the fp32 ``.grad``): ``4 N_t``;
* during a step only, under ``fsdp``: no whole-model copies (FSDP2's gathered parameters are the
  compute copies; :attr:`Precision.master_weights` is off), but every FSDP unit while gathered
  holds its compute copy (2 bytes under bf16, else ``w``) and its unsharded gradient before the
  reduce-scatter (``w``, the fp32 reduce dtype): the block computing and the one prefetched
  (:data:`FSDP_UNSHARDED_LAYERS`), and the root (embeddings, final norm, head), which
  :func:`seqpar.parallel.fsdp.apply_fsdp` keeps gathered from its forward to its backward.

So for bf16 + fsdp the kept state is ``16 N_t / dp``, not ``20 N_t / dp``: the 4 bytes of bf16
copies per parameter exist under ddp only. This is what
:func:`seqpar.parallel.data_parallel.state_bytes` measures on the tensors. Left out: AdamW's step
counters (4 bytes per tensor) and ``bf16-autocast``'s bf16 casts of the weights, which autograd
saves with the activations.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import GPTConfig
from ..model.modes import DATA_PARALLEL_MODES, PRECISIONS
from .params import layer_params, root_params, stage_params

FSDP_UNSHARDED_LAYERS = 2  # the layer computing and the one prefetched


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one rank's TP shard (before dp sharding)."""

    parameters: int     # kept: the parameters (fp32 masters under bf16)
    gradients: int      # kept: their .grad
    optimizer: int      # kept: AdamW's two moments
    sharded: bool       # fsdp over dp > 1: the kept bytes are divided by dp
    step_copies: int    # during a step, per parameter of the whole shard (ddp + bf16: 2 + 2)
    gathered: int       # during a step, per parameter of a gathered FSDP unit: compute copy + gradient

    @property
    def kept(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def state_bytes_per_parameter(precision: str, data_parallel: str, *, dp: int = 1, param_bytes: int = 4) -> StateBytes:
    """The per-parameter bytes of the module docstring for a resolved ``precision`` and ``data_parallel``
    over ``dp`` ranks, with parameters of ``param_bytes`` bytes."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    w = param_bytes
    if data_parallel == "fsdp" and dp > 1:
        compute = 2 if precision == "bf16" else w
        return StateBytes(w, w, 2 * w, True, 0, compute + w)
    return StateBytes(w, w, 2 * w, False, 4 if precision == "bf16" else 0, 0)


def training_state_bytes(per: StateBytes, *, params: int, unit_params: int, root: int, dp: int) -> dict[str, float]:
    """``{"parameters", "gradients", "optimizer"}`` bytes per rank kept across steps and
    ``"step_transient"`` (what a step adds while it runs), for ``params`` parameters on the rank,
    ``unit_params`` in one transformer layer (one FSDP unit) and ``root`` in the root unit."""
    shard = dp if per.sharded else 1
    transient = per.step_copies * params + per.gathered * (FSDP_UNSHARDED_LAYERS * unit_params + root)
    return {"parameters": params * per.parameters / shard, "gradients": params * per.gradients / shard,
            "optimizer": params * per.optimizer / shard, "step_transient": float(transient)}


def state_bytes_formula(model: GPTConfig, *, t: int, dp: int = 1, data_parallel: str = "ddp",
                        precision: str = "fp32", pp: int = 1, stage: int = 0) -> dict[str, float]:
    """:func:`training_state_bytes` of pipeline stage ``stage`` of ``pp`` of ``model`` at TP size ``t``."""
    per = state_bytes_per_parameter(precision, data_parallel, dp=dp, param_bytes=model.torch_dtype.itemsize)
    root = root_params(model, t, first=stage == 0, last=stage == pp - 1, pp=pp)
    return training_state_bytes(per, params=stage_params(model, t=t, pp=pp, stage=stage),
                                unit_params=layer_params(model, t), root=root, dp=dp)


def state_table(model: GPTConfig, *, t: int, layouts: list[tuple[int, str]], precision: str = "fp32") -> str:
    """A Markdown table of :func:`state_bytes_formula` for each ``(dp, data_parallel)`` in ``layouts``."""
    lines = [f"Training state per rank at t={t}, precision {precision}, model.dtype {model.dtype} "
             f"(kept across steps; AdamW step counters left out):", "",
             "| dp | data_parallel | parameters | gradients | optimizer | total | + during a step |",
             "|---|---|---|---|---|---|---|"]
    for dp, mode in layouts:
        b = state_bytes_formula(model, t=t, dp=dp, data_parallel=mode, precision=precision)
        kept = [b[k] for k in ("parameters", "gradients", "optimizer")]
        cells = [f"{x / 2**30:.3f} GiB" for x in (*kept, sum(kept), b["step_transient"])]
        lines.append(f"| {dp} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["FSDP_UNSHARDED_LAYERS", "StateBytes", "state_bytes_formula", "state_bytes_per_parameter",
           "state_table", "training_state_bytes"]

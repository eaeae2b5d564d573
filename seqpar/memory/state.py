"""Training-state bytes per rank from formulas: parameters, gradients and AdamW state.

For a model held as this TP rank's shards (``N_t`` parameters: the layers' matrices and column
biases split t ways, norms and row biases whole, the embedding split t ways, learned positions
whole; :func:`seqpar.plan.memory.stage_params` with one pipeline stage) the Trainer keeps, per
parameter, in the parameters' dtype ``w`` (4 bytes for ``model.dtype: float32``, which every
bf16 mode needs for its fp32 masters):

* parameters ``w``, gradients ``w`` (``.grad``; the bf16 recipe accumulates fp32 gradients),
  AdamW ``2w`` (``exp_avg`` and ``exp_avg_sq``);
* ``data_parallel: fsdp`` divides all three by ``dp`` (FSDP2 keeps one dim-0 slice of each
  tensor per dp rank); ``ddp`` replicates them.

This is what :func:`seqpar.parallel.data_parallel.state_bytes` measures on the tensors. Left out:
AdamW's step counters (4 bytes per tensor), and what lives only during a step: the bf16 compute
copies of the parameters and their bf16 gradients (the bf16 recipe under ddp, ``2 N_t`` bytes
each) or FSDP's gathered bf16 parameters of the block running (and the one prefetched).
"""
from __future__ import annotations

import torch

from ..model.config import GPTConfig


def state_bytes_formula(model: GPTConfig, *, t: int, dp: int = 1, data_parallel: str = "ddp",
                        precision: str = "fp32") -> dict[str, float]:
    """``{"parameters", "gradients", "optimizer"}`` bytes per rank kept across steps, and
    ``"step_transient"``: what one step adds while it runs (see the module docstring)."""
    from ..plan.layout import Layout
    from ..plan.memory import FSDP_UNSHARDED_LAYERS, layer_params, stage_params
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
    if precision not in ("fp32", "bf16", "bf16-autocast"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'bf16-autocast', got {precision!r}")
    n = stage_params(model, Layout(tp=t, pp=1, dp=dp), 0)
    w = torch.empty((), dtype=model.torch_dtype).element_size()
    sharded = data_parallel == "fsdp" and dp > 1
    shard = dp if sharded else 1
    compute = 2 if precision == "bf16" else w  # bytes of a gathered / compute copy
    if sharded:  # the gathered copies of the block running and the one prefetched, and their grads
        transient = FSDP_UNSHARDED_LAYERS * layer_params(model, t) * (compute + w)
    else:        # the bf16 recipe's compute copies and their bf16 grads
        transient = 4 * n if precision == "bf16" else 0
    return {"parameters": n * w / shard, "gradients": n * w / shard, "optimizer": 2 * n * w / shard,
            "step_transient": float(transient)}


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


__all__ = ["state_bytes_formula", "state_table"]

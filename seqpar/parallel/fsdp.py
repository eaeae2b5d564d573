"""FSDP2 over the data-parallel dimension, applied from outside on top of seqpar's TP + SP layers.

:func:`apply_fsdp` calls ``torch.distributed.fsdp.fully_shard`` on every transformer block and
then on the root, over the mesh's 1-D ``dp`` DeviceMesh. Each rank keeps ``1/dp`` of its TP
shard of every parameter (dim 0, ``torch.chunk`` sizes), of its gradient and of the AdamW
moments the optimizer creates for it; a block's parameters are all-gathered over dp just before
its forward (and again before its backward when ``reshard_after_forward``), its gradients
reduce-scattered over dp after its backward. The TP + SP collectives inside the layers are
untouched: FSDP sees the TP-local tensors as ordinary parameters.

SP-replicated gradients (norms, row biases, learned positions) are partial sums over the
sequence shards of the TP group. They are summed over TP once per optimizer step, on the dp
shards after FSDP's reduce-scatter (:func:`sync_sharded_sp_grads`): summing over tp and averaging
over dp commute, so the result is the same as summing before, with ``1/dp`` of the bytes, and
bit-identical on the TP ranks (one all-reduce gives every member the same values).

Mixed precision: ``train.precision=bf16`` becomes ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the sharded parameters are the fp32 masters the optimizer updates, the
gathered ones bf16, gradients reduce-scattered in fp32 into fp32 shards.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce_coalesced, group_size
from ..sharding import local_tensor, sp_replicated_parameters


def mixed_precision_policy(precision: str):
    """FSDP2's policy for a resolved ``train.precision``: bf16 compute on fp32 shards, fp32
    reduce-scatter, for ``bf16``; parameters' own dtype otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh, *, reshard_after_forward: bool = True, precision: str = "fp32",
               expert_mesh=None, experts: Sequence[nn.Parameter] = ()) -> nn.Module:
    """Shard ``model`` (a seqpar ``GPT``) over ``dp_mesh``: one FSDP unit per block in
    ``model.blocks``, then the root (embeddings, final norm, head). Modifies ``model`` in place
    (its parameters become DTensors) and returns it. The root keeps its parameters gathered
    after forward (it runs last in forward and first in backward). Expert parallelism: each MoE
    layer's routed experts (``experts``) form a unit of their own over ``expert_mesh`` (the
    expert-data-parallel ranks), or stay plain, reduced by the caller, when it is None (edp = 1)."""
    from torch.distributed.fsdp import fully_shard
    policy = mixed_precision_policy(precision)
    ignored = set(experts) if expert_mesh is None else set()
    for block in model.blocks:
        grouped = getattr(getattr(block, "mlp", None), "experts", None)
        if experts and expert_mesh is not None and grouped is not None:
            fully_shard(grouped, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored or None)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored or None)
    return model


def set_micro_batch(model: nn.Module, last: bool) -> None:
    """Before each micro-batch's backward under gradient accumulation: reduce-scatter gradients
    (and reshard after backward) only on the ``last`` micro-batch of the optimizer step, so the
    micro-batches before it accumulate unsharded gradients without re-gathering parameters."""
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


@torch.no_grad()
def sync_sharded_sp_grads(model: nn.Module, tp_group: ProcessGroup | None) -> int:
    """Sum the SP-replicated gradients over TP on their dp shards (after FSDP's reduce-scatter),
    coalesced into one buffer per dtype. Returns the number of parameters reduced."""
    if group_size(tp_group) == 1:
        return 0
    grads = [local_tensor(p.grad) for p in sp_replicated_parameters(model) if p.grad is not None]
    all_reduce_coalesced(grads, tp_group)  # in place on the shards' storage
    return len(grads)


def reshard(model: nn.Module) -> int:
    """Free the gathered parameters of every FSDP2 unit in ``model`` and register the dp shards
    again. A forward without backward (evaluation, sampling) leaves the root unit -- which keeps
    its parameters gathered after forward -- holding unsharded parameters, and then
    ``named_parameters()`` yields tensors the optimizer does not know. Returns the units resharded."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    return len(units)


def shard_rows(full_rows: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """``(first row, rows)`` of dim 0 that FSDP2 gives dp rank ``dp_rank`` of ``dp``
    (``torch.chunk`` sizes: ``ceil(n / dp)`` each, the last ones shorter or empty)."""
    size = -(-full_rows // dp) if full_rows else 0
    start = min(dp_rank * size, full_rows)
    return start, min(size, full_rows - start)


__all__ = ["apply_fsdp", "mixed_precision_policy", "reshard", "set_micro_batch",
           "shard_rows", "sync_sharded_sp_grads"]

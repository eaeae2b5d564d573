"""The linear layers' bias: inside the GEMM (one addmm, no separate add) wherever it is local; the
row-parallel bias at t > 1 added once, after the reduction, exactly as before."""
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_harness import tp_group_of
from seqpar.distributed.collectives import all_reduce, group_rank
from seqpar.distributed.regions import reduce_scatter_to_sp
from seqpar.layers.functional import column_parallel_linear, row_parallel_linear


class _Ops(TorchDispatchMode):
    """The aten operators a call runs."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_one_rank_linears_add_the_bias_inside_the_gemm():
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 2, 8), torch.randn(6, 8), torch.randn(6)
    for fn in (column_parallel_linear, row_parallel_linear):
        for sp in (False, True):
            with _Ops() as seen:
                y = fn(x, w, b, tp_group=None, sequence_parallel=sp)
            assert "addmm" in seen.ops and "add" not in seen.ops, (fn.__name__, sp, seen.ops)
            assert torch.equal(y, F.linear(x, w, b)), (fn.__name__, sp)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the separate add, and its fp32 result, as at t > 1
        assert row_parallel_linear(x, w, b, tp_group=None).dtype == torch.float32


def _row_bias_after_reduce(rank, world):
    group = tp_group_of(2)
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 2, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64), torch.randn(6)
    b = b.double()
    r = group_rank(group)
    xs, ws = x[..., r * 4:(r + 1) * 4], w[:, r * 4:(r + 1) * 4]
    partial = F.linear(xs, ws)
    summed = partial.clone()
    all_reduce(summed, group)
    plain = torch.equal(row_parallel_linear(xs, ws, b, tp_group=group), summed + b)
    sp = torch.equal(row_parallel_linear(xs, ws, b, tp_group=group, sequence_parallel=True),
                     reduce_scatter_to_sp(partial, group) + b)
    return plain, sp


def test_row_parallel_bias_is_added_after_the_reduction(spawn):
    assert spawn(_row_bias_after_reduce, 2) == [(True, True), (True, True)]

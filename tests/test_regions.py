"""The paper's operators against hand-computed forward and backward values."""
import torch
import torch.distributed as dist

from distributed_harness import tp_group_of
from seqpar.distributed import (
    copy_to_tp,
    count_comm,
    gather_from_sp,
    gather_from_tp,
    gather_to_replicated,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    split_to_tp,
)


def _val(rank, shape):
    """A tensor that differs per rank: rank*100 + arange."""
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 100 * rank)


def _fwd_bwd(op, x, grad):
    x = x.clone().requires_grad_(True)
    y = op(x)
    y.backward(grad)
    return y.detach(), x.grad


def _operators(rank, world):
    t = world
    g = dist.group.WORLD
    out = {}
    # f: identity forward, all-reduce backward
    x, gr = _val(rank, (4, 2)), _val(rank, (4, 2))
    y, dx = _fwd_bwd(lambda v: copy_to_tp(v, g), x, gr)
    out["f"] = (torch.equal(y, x), torch.equal(dx, sum(_val(r, (4, 2)) for r in range(t))))
    # f-bar: all-reduce forward, identity backward
    y, dx = _fwd_bwd(lambda v: reduce_from_tp(v, g), x, gr)
    out["fbar"] = (torch.equal(y, sum(_val(r, (4, 2)) for r in range(t))), torch.equal(dx, gr))
    # g: all-gather along seq (dim 0) forward, reduce-scatter backward
    shard = _val(rank, (2, 3, 2))
    full_grad = _val(rank, (2 * t, 3, 2))
    y, dx = _fwd_bwd(lambda v: gather_from_sp(v, g), shard, full_grad)
    exp_y = torch.cat([_val(r, (2, 3, 2)) for r in range(t)], 0)
    exp_dx = sum(_val(r, (2 * t, 3, 2)) for r in range(t))[2 * rank:2 * rank + 2]
    out["g"] = (torch.equal(y, exp_y), torch.equal(dx, exp_dx))
    # g-bar: reduce-scatter forward, all-gather backward
    full = _val(rank, (2 * t, 3, 2))
    y, dx = _fwd_bwd(lambda v: reduce_scatter_to_sp(v, g), full, _val(rank, (2, 3, 2)))
    exp_y = sum(_val(r, (2 * t, 3, 2)) for r in range(t))[2 * rank:2 * rank + 2]
    exp_dx = torch.cat([_val(r, (2, 3, 2)) for r in range(t)], 0)
    out["gbar"] = (torch.equal(y, exp_y), torch.equal(dx, exp_dx))
    # scatter: keep own chunk forward, all-gather backward
    y, dx = _fwd_bwd(lambda v: scatter_to_sp(v, g), full, _val(rank, (2, 3, 2)))
    out["scatter"] = (torch.equal(y, full[2 * rank:2 * rank + 2]), torch.equal(dx, exp_dx))
    # gather_to_replicated: all-gather seq forward, own chunk of the replicated grad backward
    y, dx = _fwd_bwd(lambda v: gather_to_replicated(v, g), _val(rank, (2, 3, 2)), _val(0, (2 * t, 3, 2)))
    out["to_replicated"] = (torch.equal(y, torch.cat([_val(r, (2, 3, 2)) for r in range(t)], 0)),
                            torch.equal(dx, _val(0, (2 * t, 3, 2))[2 * rank:2 * rank + 2]))
    # gather_from_tp: all-gather last dim forward, own chunk backward
    y, dx = _fwd_bwd(lambda v: gather_from_tp(v, g), _val(rank, (3, 2)), _val(rank, (3, 2 * t)))
    out["gather_tp"] = (torch.equal(y, torch.cat([_val(r, (3, 2)) for r in range(t)], -1)),
                        torch.equal(dx, _val(rank, (3, 2 * t))[:, 2 * rank:2 * rank + 2]))
    # split_to_tp: own chunk forward, all-gather backward
    y, dx = _fwd_bwd(lambda v: split_to_tp(v, g), _val(rank, (3, 2 * t)), _val(rank, (3, 2)))
    out["split_tp"] = (torch.equal(y, _val(rank, (3, 2 * t))[:, 2 * rank:2 * rank + 2]),
                       torch.equal(dx, torch.cat([_val(r, (3, 2)) for r in range(t)], -1)))
    # batch-first: seq_dim=1
    shard = _val(rank, (3, 2, 2))
    y, dx = _fwd_bwd(lambda v: gather_from_sp(v, g, seq_dim=1), shard, _val(rank, (3, 2 * t, 2)))
    out["g_seqdim1"] = (torch.equal(y, torch.cat([_val(r, (3, 2, 2)) for r in range(t)], 1)),
                        torch.equal(dx, sum(_val(r, (3, 2 * t, 2)) for r in range(t))[:, 2 * rank:2 * rank + 2]))
    y, dx = _fwd_bwd(lambda v: reduce_scatter_to_sp(v, g, seq_dim=1), _val(rank, (3, 2 * t, 2)), _val(rank, (3, 2, 2)))
    out["gbar_seqdim1"] = (torch.equal(y, sum(_val(r, (3, 2 * t, 2)) for r in range(t))[:, 2 * rank:2 * rank + 2]),
                           torch.equal(dx, torch.cat([_val(r, (3, 2, 2)) for r in range(t)], 1)))
    # one-rank group: identity, no communication
    single = tp_group_of(1)
    with count_comm() as c:
        z = _val(rank, (4, 2)).requires_grad_(True)
        w = reduce_scatter_to_sp(gather_from_sp(copy_to_tp(reduce_from_tp(z, single), single), single), single)
        w.sum().backward()
    out["single"] = (w is z or torch.equal(w, z), c.total_bytes() == 0 and torch.equal(z.grad, torch.ones(4, 2)))
    # byte counter: g moves the gathered tensor forward, reduce-scatters it backward
    with count_comm() as c:
        _fwd_bwd(lambda v: gather_from_sp(v, g), _val(rank, (2, 3, 2)), _val(rank, (2 * t, 3, 2)))
    out["counter"] = (c.calls == {"all_gather": 1, "reduce_scatter": 1},
                      c.bytes == {"all_gather": 2 * t * 6 * 8, "reduce_scatter": 2 * t * 6 * 8})
    return out


def test_operators_forward_backward_hand_computed(spawn):
    for world in (2, 4):
        results = spawn(_operators, world)
        for rank, res in enumerate(results):
            for name, (fwd_ok, bwd_ok) in res.items():
                assert fwd_ok, f"{name} forward wrong on rank {rank} of {world}"
                assert bwd_ok, f"{name} backward wrong on rank {rank} of {world}"


def _bad_dims(rank, world):
    g = dist.group.WORLD
    msgs = []
    for fn in (lambda: reduce_scatter_to_sp(torch.zeros(5, 2), g), lambda: scatter_to_sp(torch.zeros(2, 5), g, 1),
               lambda: split_to_tp(torch.zeros(2, 3), g), lambda: gather_from_sp(torch.zeros(2, 3), g, 4)):
        try:
            fn()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    dist.barrier()  # every rank reaches this only if none of them entered a collective above
    return msgs


def test_indivisible_dims_raise_on_every_rank(spawn):
    """Errors name the operator, ``seq_dim``, the shape and t, and say which seq_dim fits which layout."""
    for msgs in spawn(_bad_dims, 2):
        assert msgs[0].startswith("reduce_scatter_to_sp: the sequence dim seq_dim=0 of shape (5, 2) (5) is not")
        assert "t=2" in msgs[0] and "1 for batch-first [b, s, h]" in msgs[0]
        assert msgs[1].startswith("scatter_to_sp: the sequence dim seq_dim=1 of shape (2, 5) (5)")
        assert msgs[2].startswith("split_to_tp: the last (feature) dim of shape (2, 3) (3)") and "t=2" in msgs[2]
        assert msgs[3].startswith("gather_from_sp: seq_dim: dim 4 is out of range") and "(2, 3)" in msgs[3]

"""SP-replicated parameters (norms, row bias) end bit-identical on all TP ranks after grad_sync."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distributed_harness import rel_err, run_ranks
from seqpar.distributed import install_sp_grad_hooks, mark_sp_replicated, sp_replicated_parameters, sync_sp_replicated_grads
from seqpar.layers import ColumnParallelLinear, RowParallelLinear

S, B, H = 8, 2, 12


class Block(nn.Module):
    def __init__(self, group, sp):
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=torch.float64)
        if sp:
            mark_sp_replicated(self.norm)
        self.fc1 = ColumnParallelLinear(H, 4 * H, tp_group=group, sequence_parallel=sp, dtype=torch.float64)
        self.fc2 = RowParallelLinear(4 * H, H, tp_group=group, sequence_parallel=sp, dtype=torch.float64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _run(group, mode, micro_batches=1):
    torch.manual_seed(0)
    model = Block(group, sp=True)
    with torch.no_grad():  # make the norm's affine parameters non-trivial
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    if mode == "hooks":
        install_sp_grad_hooks(model, group)
    t, r = dist.get_world_size(group), dist.get_rank(group)
    for mb in range(micro_batches):
        x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + mb))
        y = model(x[r * S // t:(r + 1) * S // t])
        (y.pow(2).sum()).backward()
    if mode == "sync":
        sync_sp_replicated_grads(model, group)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _dense_grads(micro_batches=1):
    torch.manual_seed(0)
    model = Block(None, sp=False)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    for mb in range(micro_batches):
        x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + mb))
        model(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _double_sum_refused(group):
    """sync after hooks (or hooks twice) raises before summing; without the hooks sync runs again."""
    torch.manual_seed(0)
    model = Block(group, sp=True)
    handles = install_sp_grad_hooks(model, group)
    model(torch.randn(S // 2, B, H, dtype=torch.float64)).sum().backward()
    before = model.norm.weight.grad.clone()
    errors = []
    for call in (lambda: sync_sp_replicated_grads(model, group), lambda: install_sp_grad_hooks(model, group)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    unchanged = torch.equal(model.norm.weight.grad, before)
    for h in handles:
        h.remove()
    return errors, unchanged, sync_sp_replicated_grads(model, group)


def _grad_sync(rank, world):
    group = dist.group.WORLD
    return {"none": _run(group, "none"), "sync": _run(group, "sync"), "hooks": _run(group, "hooks"),
            "hooks_accum": _run(group, "hooks", micro_batches=2), "sync_accum": _run(group, "sync", 2),
            "double": _double_sum_refused(group)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_grad_sync, 2, tmp_path_factory.mktemp("grad_sync"))


def test_replicated_grads_bit_identical_after_sync(ranks):
    res = ranks
    dense, dense2 = _dense_grads(), _dense_grads(2)
    # without the sync the norm's grads are partial and differ between ranks: the bug class it fixes
    assert not torch.equal(res[0]["none"]["norm.weight"], res[1]["none"]["norm.weight"])
    for mode, ref in (("sync", dense), ("hooks", dense), ("hooks_accum", dense2), ("sync_accum", dense2)):
        for name in ("norm.weight", "norm.bias", "fc2.bias"):
            assert torch.equal(res[0][mode][name], res[1][mode][name]), f"{mode}: {name} differs across TP ranks"
            assert rel_err(res[0][mode][name], ref[name]) < 1e-12, f"{mode}: {name} differs from the dense grad"


def test_sync_after_hooks_refuses_to_sum_twice(ranks):
    """Hooks then an explicit sync would double the norm gradients: both orders of doubling raise,
    name the parameters and the other function, and change nothing; removing the hooks allows sync."""
    for errors, unchanged, synced_after_removal in (r["double"] for r in ranks):
        assert len(errors) == 2, errors
        sync_err, hooks_err = errors
        assert sync_err.startswith("sync_sp_replicated_grads:") and "install_sp_grad_hooks" in sync_err
        assert "norm.weight" in sync_err and "fc2.bias" in sync_err and "parallelize" in sync_err
        assert hooks_err.startswith("install_sp_grad_hooks:")
        assert unchanged
        assert synced_after_removal == 3  # norm.weight, norm.bias, fc2.bias


def test_tagging_only_under_sequence_parallelism():
    plain = RowParallelLinear(8, 8, tp_group=None, sequence_parallel=True)
    assert sp_replicated_parameters(plain) == []  # one rank: nothing to reduce
    norm = nn.LayerNorm(4)
    mark_sp_replicated(norm, ["weight"])
    assert sp_replicated_parameters(norm) == [norm.weight]
    try:
        mark_sp_replicated(norm, ["scale"])
    except ValueError as e:
        assert "scale" in str(e) and "weight" in str(e)
    else:
        raise AssertionError("unknown parameter name accepted")

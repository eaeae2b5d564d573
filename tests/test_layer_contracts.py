"""Saved-for-backward bytes, dropout streams, layout-invariant init, errors, repr, mesh."""
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_harness import tp_group_of
from seqpar import init_parallel
from seqpar.distributed import RNGStreams, capture_rng, replay_rng
from seqpar.distributed.mesh import validate_layout
from seqpar.memory import ActivationLedger
from seqpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

S, B, H = 8, 2, 16


def _saved_bytes(module, x):
    """Bytes of distinct storages ``module(x)`` saves for backward, parameters excluded."""
    with ActivationLedger(module) as ledger:
        module(x)
    return ledger.total()


class _CountCopies(TorchDispatchMode):
    """Records every aten op outside torch.distributed that materialises a copy of a tensor."""

    COPY_OPS = {"aten.clone.default", "aten.copy_.default", "aten.cat.default", "aten._to_copy.default",
                "aten.contiguous.default"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # gloo stages some results through its own buffers inside the collective call or its
        # Work.wait(): those copies belong to the backend, not to the layers
        if str(func) in self.COPY_OPS and not any(
                "distributed_c10d" in f.filename or (f.line or "").endswith(".wait()") for f in traceback.extract_stack()):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _contracts(rank, world):
    out = {}
    group = dist.group.WORLD
    t = world
    # 1. SP column layer keeps only the local shard for backward
    for sp in (True, False):
        col = ColumnParallelLinear(H, 4 * H, tp_group=group, sequence_parallel=sp)
        x = torch.randn((S // t if sp else S), B, H, requires_grad=True)
        out[("saved", sp)] = (_saved_bytes(col, x), x.numel() * x.element_size())
    # 1b. the SP MLP adds no tensor copies beyond the collectives' own buffers
    col = ColumnParallelLinear(H, 4 * H, tp_group=group, sequence_parallel=True)
    row = RowParallelLinear(4 * H, H, tp_group=group, sequence_parallel=True)
    x = torch.randn(S // t, B, H, requires_grad=True)
    with _CountCopies() as copies:
        y = row(torch.nn.functional.gelu(col(x)))
        y.backward(torch.ones_like(y))  # a dense upstream gradient, as a real loss gives
    out["copies"] = copies.names
    # 2. dropout masks: TP stream differs across ranks, replicated stream is identical
    streams = RNGStreams(seed=7, tp_rank=rank)
    before = torch.get_rng_state()
    with streams.fork("tp"):
        tp_mask = torch.native_dropout(torch.ones(64), 0.5, True)[1]
    with streams.fork("replicated"):
        rep_mask = torch.native_dropout(torch.ones(64), 0.5, True)[1]
    with streams.fork("tp"):  # the stream advances: a second draw differs from the first
        tp_mask2 = torch.native_dropout(torch.ones(64), 0.5, True)[1]
    out["masks"] = (tp_mask, rep_mask, tp_mask2, torch.equal(before, torch.get_rng_state()))
    snap = capture_rng(streams)
    with streams.fork("tp"):
        a = torch.rand(5)
    with replay_rng(snap, streams), streams.fork("tp"):
        b = torch.rand(5)
    out["replay"] = torch.equal(a, b)
    # 3. layout-invariant initialisation: same seed -> same full weights for any t
    for tt in (1, 2, 4):
        g = tp_group_of(tt)
        torch.manual_seed(11)
        col = ColumnParallelLinear(H, 2 * H, tp_group=g)
        row = RowParallelLinear(2 * H, H, tp_group=g)
        emb = VocabParallelEmbedding(32, H, tp_group=g)
        out[("init", tt)] = (col.dense_weight(), col.dense_bias(), row.dense_weight(), row.dense_bias(),
                             emb.dense_weight())
        if tt == 4:
            out["repr"] = repr(col)
            torch.manual_seed(11)
            shard = ColumnParallelLinear(H, 2 * H, tp_group=g, per_shard_init=True)
            out["per_shard"] = shard.weight.detach().clone()
    # 4. bad input raises ValueError on every rank before any collective
    errors = {}
    for name, fn in {
        "out_features": lambda: ColumnParallelLinear(H, 6, tp_group=group),
        "in_features": lambda: RowParallelLinear(6, H, tp_group=group),
        "vocab": lambda: VocabParallelEmbedding(30, H, tp_group=group),
        "group_type": lambda: ColumnParallelLinear(H, H, tp_group="tp"),
        "input_dim": lambda: ColumnParallelLinear(H, H, tp_group=group, sequence_parallel=True)(torch.randn(2, B, H + 1)),
        "sequence": lambda: VocabParallelEmbedding(32, H, tp_group=group, sequence_parallel=True)(
            torch.zeros(S + 1, B, dtype=torch.long)),
        "ids_range": lambda: VocabParallelEmbedding(32, H, tp_group=group)(torch.full((S, B), 40)),
        "row_input": lambda: RowParallelLinear(2 * H, H, tp_group=group)(torch.randn(S, B, 2 * H)),
    }.items():
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    sub = dist.new_group([0, 1])  # ranks 2, 3 are not members
    try:
        ColumnParallelLinear(H, H, tp_group=sub)
        errors["membership"] = None
    except ValueError as e:
        errors["membership"] = str(e)
    dist.barrier()  # reached by every rank only if none is stuck in a collective
    out["errors"] = errors
    # 5. the mesh from the initialised world
    mesh = init_parallel(tp=2)
    out["mesh"] = (mesh.tp_rank, mesh.dp_rank, mesh.tp_size, mesh.dp_size, dist.get_world_size(mesh.tp_group),
                   dist.get_world_size(mesh.dp_group))
    return out


def test_layer_contracts(spawn):
    res = spawn(_contracts, 4)
    for rank, r in enumerate(res):
        got, shard = r[("saved", True)]
        assert got == shard, f"SP column saved {got} bytes, its input shard is {shard}"
        got, full = r[("saved", False)]
        assert got == full
        assert r["copies"] == [], f"SP MLP forward/backward made copies: {r['copies']}"
        assert r["masks"][3], "fork() changed the default generator"
        assert not torch.equal(r["masks"][0], r["masks"][2])
        assert r["replay"]
        assert "tp_rank=" in r["repr"] and "tp_size=4" in r["repr"] and "local_weight=(8, 16)" in r["repr"]
        e = r["errors"]
        assert "out_features 6 " in e["out_features"] and "t=4" in e["out_features"]
        assert "(6)" in e["in_features"]
        assert "(30)" in e["vocab"]
        assert "ProcessGroup" in e["group_type"] and "str" in e["group_type"]
        assert "17" in e["input_dim"] and "16" in e["input_dim"]
        assert "(9)" in e["sequence"]
        assert "40" in e["ids_range"] and "32" in e["ids_range"]
        assert "32" in e["row_input"] and "8" in e["row_input"]
        assert (e["membership"] is None) == (rank < 2), e["membership"]
        assert r["mesh"] == (rank % 2, rank // 2, 2, 2, 2, 2)
    tp_masks = [r["masks"][0] for r in res]
    assert not torch.equal(tp_masks[0], tp_masks[1]), "TP-stream masks must differ across TP ranks"
    assert all(torch.equal(r["masks"][1], res[0]["masks"][1]) for r in res), "replicated masks must agree"
    for tt in (2, 4):
        for a, b in zip(res[0][("init", 1)], res[0][("init", tt)]):
            assert torch.equal(a, b), f"init differs between t=1 and t={tt}"
    torch.manual_seed(11)
    dense = nn.Linear(H, 2 * H)
    assert torch.equal(dense.weight, res[0][("init", 1)][0]) and torch.equal(dense.bias, res[0][("init", 1)][1])
    assert not torch.equal(res[0]["per_shard"], res[1]["per_shard"])


def test_layout_validation_names_values():
    with pytest.raises(ValueError, match=r"dp=3 x tp=2 = 6, world size = 4"):
        validate_layout(2, 3, 4)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp=4"):
        validate_layout(4, None, 6)
    assert validate_layout(2, None, 8) == 4


def test_single_rank_mesh_without_process_group(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    mesh = init_parallel(tp=1)
    assert (mesh.tp_size, mesh.dp_size, mesh.tp_group) == (1, 1, None)
    layer = ColumnParallelLinear(4, 8, tp_group=mesh.tp_group, sequence_parallel=True)
    assert layer(torch.randn(3, 2, 4)).shape == (3, 2, 8)

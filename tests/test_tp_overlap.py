"""Overlapped TP communication (``parallel.tp_overlap``): SP's all-gather and reduce-scatter cut into
per-rank chunks under the GEMMs give the plain layers' results (fp64 <= 1e-10, forward and
backward, t = 2 and 4), move the same bytes and keep the same tensors for backward."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from distributed_harness import rel_err, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from run_helpers import learnable_overrides, run_overrides, train_rank
from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.distributed import count_comm
from seqpar.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.model import GPT
from seqpar.parallel import apply_tp_overlap
from seqpar.train import Trainer

S, B, H, F = 8, 2, 12, 8  # sequence, batch, in and out features (tiny: the checks are exact)


def _saved_bytes(layer, fn):
    """Run ``fn``; return its result and the bytes of the distinct storages autograd saved that are
    not ``layer``'s parameters (views of a weight included)."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _run(layer, x_full, grad_full, t, r, *, seq_dim=0, input_grad=True):
    """Forward and backward of ``layer`` on this rank's part of ``x_full``; returns the output,
    the gradients (input, weight, bias), the comm counter and the saved bytes."""
    layer.zero_grad(set_to_none=True)
    x = x_full
    if isinstance(layer, ColumnParallelLinear):  # input: this rank's sequence shard
        x = x_full.chunk(t, dim=seq_dim)[r]
    x = x.clone().requires_grad_(input_grad)
    with count_comm() as comm:
        out, saved = _saved_bytes(layer, lambda: layer(x))
        grad = grad_full if isinstance(layer, ColumnParallelLinear) else grad_full.chunk(t, dim=seq_dim)[r]
        out.backward(grad.contiguous())
    b = None if layer.bias is None else layer.bias.grad
    return out.detach(), (x.grad, layer.weight.grad, b), comm, saved


def _pair(layer_cls, bias, group, seq_dim=0, input_grad=True):
    """One layer run plain, then overlapped, on the same inputs; max relative error over the output
    and all gradients, the two comm counters and the two saved byte counts."""
    t, r = group.size(), group.rank()
    gen = torch.Generator().manual_seed(1)
    dense = nn.Linear(H, F, bias=bias, dtype=torch.float64)
    with torch.no_grad():  # the same dense layer on every rank
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    shape = (S, B) if seq_dim == 0 else (B, S)
    x_full = torch.randn(*shape, H if layer_cls is ColumnParallelLinear else H // t, generator=gen, dtype=torch.float64)
    out_f = F // t if layer_cls is ColumnParallelLinear else F
    grad_full = torch.randn(*shape, out_f, generator=gen, dtype=torch.float64)
    layer = layer_cls.from_dense(dense, tp_group=group, sequence_parallel=True, seq_dim=seq_dim)
    runs = []
    for overlap in (False, True):
        layer.tp_overlap = overlap
        runs.append(_run(layer, x_full, grad_full, t, r, seq_dim=seq_dim, input_grad=input_grad))
    (out0, g0, c0, s0), (out1, g1, c1, s1) = runs
    err = max([rel_err(out1, out0)] + [rel_err(a, b) for a, b in zip(g1, g0) if b is not None])
    missing = [i for i, (a, b) in enumerate(zip(g1, g0)) if (a is None) != (b is None)]
    return {"err": err, "missing": missing, "wire": (c0.wire_bytes(t), c1.wire_bytes(t)),
            "kinds": (dict(c0.calls), dict(c1.calls)), "saved": (s0, s1)}


def _layer_checks(rank, world):
    group = tp_group_of(world)
    out = {}
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for bias in (True, False):
            out[(cls.__name__, bias)] = _pair(cls, bias, group)
        out[(cls.__name__, "seq_dim=1")] = _pair(cls, True, group, seq_dim=1)
        out[(cls.__name__, "no input grad")] = _pair(cls, True, group, input_grad=False)
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_overlapped_layers_equal_the_plain_ones(spawn, t):
    n = S * B * H // t * 8  # bytes of the column layer's input shard [s/t, b, h] in fp64
    for r in spawn(_layer_checks, t):
        for key, c in r.items():
            assert c["err"] <= 1e-10 and not c["missing"], (key, c)
            assert c["wire"][1] == c["wire"][0] > 0, (key, c["wire"])  # the same bytes on the wire
            assert set(c["kinds"][1]) == {"send_recv"}, (key, c["kinds"])  # and only the ring moved them
            assert c["saved"][1] == c["saved"][0], (key, c["saved"])  # the same tensors kept for backward
        for bias in (True, False):
            assert r[("ColumnParallelLinear", bias)]["saved"][1] == n  # only the sequence shard


def _model_checks(rank, world):
    torch.manual_seed(0)
    group = tp_group_of(world)
    cfg = tiny_config(dtype="float64", recompute="selective", layers=2)
    model = GPT(cfg, mesh_for(group), seed=3)
    tokens, labels = batch(cfg)
    loss0, grads0 = loss_and_dense_grads(model, tokens, labels)
    count = apply_tp_overlap(model)
    loss1, grads1 = loss_and_dense_grads(model, tokens, labels)
    err = max(rel_err(grads1[k], grads0[k]) for k in grads0)
    mlp = GPT(tiny_config(layers=1), mesh_for(group), seed=3).blocks[0].mlp  # fp32 under bf16 autocast
    x = torch.randn(S // world, B, cfg.hidden, requires_grad=True)
    outs = []
    for overlap in (True, False):
        apply_tp_overlap(mlp, overlap)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)
        y.sum().backward()
        outs.append((y.detach(), x.grad, mlp.fc1.weight.grad))
        x.grad = mlp.fc1.weight.grad = None
    autocast_err = max(rel_err(a, b) for a, b in zip(*outs))
    return count, abs(float(loss1 - loss0)), err, outs[0][0].dtype == outs[1][0].dtype, autocast_err


def test_overlapped_gpt_equals_the_plain_one(spawn):
    for count, loss_err, grad_err, same_dtype, autocast_err in spawn(_model_checks, 2):
        assert count == 2 * 4  # qkv, proj, fc1, fc2 per layer
        assert loss_err <= 1e-12 and grad_err <= 1e-10, (loss_err, grad_err)
        assert same_dtype and autocast_err <= 1e-2, autocast_err


def _train_both(rank, world, off, on):
    runs = []
    for overrides in (off, on):
        with count_comm() as comm:
            losses = train_rank(rank, world, overrides, 2, 1)["losses"]
        runs.append((losses, comm.calls.get("send_recv", 0)))
    return runs


def test_trainer_tp_overlap_gives_the_same_losses(spawn, tmp_path):
    common = {"parallel.tp": 2, "train.steps": 4, "train.log_interval": 1, "model.recompute": "selective"}
    off = learnable_overrides(tmp_path, **common)
    on = learnable_overrides(tmp_path, **common, **{"parallel.tp_overlap": True, "out_dir": str(tmp_path / "on"),
                                                       "checkpoint.dir": str(tmp_path / "ckpt-on")})
    for (plain, rings_off), (overlapped, rings_on) in spawn(_train_both, 2, off, on):
        assert len(plain) == 4 and rings_off == 0 and rings_on > 0  # the overlapped layers ran
        assert max(abs(a - b) for a, b in zip(plain, overlapped)) <= 1e-5, (plain, overlapped)


def _pipeline_both(rank, world, tmp):
    """t=2 x p=2 (4 ranks), overlap off then on: the pipeline engine applies the mode to its stages."""
    runs = []
    for on in (False, True):
        overrides = run_overrides(Path(tmp) / str(on), {
            "model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 4, "model.layers": 2,
            "model.dropout": 0.0, "model.attention_dropout": 0.0, "train.steps": 3, "train.micro_batch": 2,
            "train.global_batch": 4, "train.precision": "fp32", "parallel.tp": 2, "parallel.pp": 2,
            "parallel.tp_overlap": on, "checkpoint.interval": 0})
        trainer = Trainer(load_run_config(None, overrides), mesh=init_parallel(tp=2, pp=2))
        with count_comm() as comm:
            losses = [trainer.train_step(step).loss for step in range(3)]
        trainer.close()
        runs.append((losses, comm.calls.get("send_recv", 0)))
    return runs


def test_pipeline_stages_take_tp_overlap(spawn, tmp_path):
    for (plain, rings_off), (overlapped, rings_on) in spawn(_pipeline_both, 4, str(tmp_path)):
        assert rings_off == 0 and rings_on > 0
        assert max(abs(a - b) for a, b in zip(plain, overlapped)) <= 1e-5, (plain, overlapped)


def test_tp_overlap_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="parallel.tp_overlap=true .* model.sequence_parallel=true"):
        load_run_config(None, ["parallel.tp_overlap=true", "model.sequence_parallel=false"])
    with pytest.raises(ValueError, match="tp_overlap=True .* sequence_parallel=True"):
        RowParallelLinear(4, 4, tp_overlap=True)
    assert load_run_config(None, []).parallel.tp_overlap is False

"""Context parallelism in the GPT: cp=2 (and cp=2 x tp=2) equal the unsplit model, GPT-2 and Llama."""
from __future__ import annotations

import pytest
import torch

from seqpar.distributed import count_comm
from seqpar.distributed.collectives import all_reduce_coalesced
from seqpar.distributed.mesh import ParallelMesh, init_parallel
from seqpar.memory.ledger import ActivationLedger
from seqpar.memory.whole_model import model_activation_bytes
from seqpar.model import GPT
from seqpar.model.config import RopeScaling
from distributed_harness import rel_err, run_ranks
from gpt_helpers import batch, loss_and_dense_grads, tiny_config

LLAMA = dict(norm="rmsnorm", position="rope", mlp="swiglu", kv_heads=2, bias=False, tie_embeddings=False,
             rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=4))


def _cp_loss_and_grads(model: GPT, tokens, labels):
    """Loss and dense grads of a CP model: the per-rank shares summed over cp first."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    all_reduce_coalesced([p.grad for p in model.parameters()], model.mesh.cp_group)
    from seqpar.distributed import sync_sp_replicated_grads
    sync_sp_replicated_grads(model, model.tp_group)
    return loss.detach(), model.to_dense({n: p.grad for n, p in model.named_parameters()})


def _compare(cfg, mesh, comm, b=2):
    tokens, labels = batch(cfg, b=b, seed=3)
    labels[0, 5] = -100  # an ignored label: the token count is summed over cp, not assumed
    ref_loss, ref = loss_and_dense_grads(GPT(cfg, ParallelMesh.single(), seed=7), tokens, labels)
    loss, grads = _cp_loss_and_grads(GPT(cfg, mesh, seed=7, cp_comm=comm), tokens, labels)
    return max([abs(float(loss - ref_loss))] + [rel_err(grads[k], ref[k]) for k in ref])


def _cp2_worker(rank, world):
    mesh = init_parallel(tp=1, dp=1, cp=2)
    errs = {}
    for name, extra in (("gpt", {}), ("llama", LLAMA)):
        for comm in ("allgather", "ring"):
            for recompute in ("none", "selective", "full"):
                for sp in (True, False):
                    cfg = tiny_config(layers=2, recompute=recompute, sequence_parallel=sp, **extra)
                    errs[(name, comm, recompute, sp)] = _compare(cfg, mesh, comm)
            # model.attention=sdpa: the blocks on the CPU flash kernel, the same model to 1e-5
            cfg = tiny_config(layers=2, recompute="selective", attention="sdpa", **extra)
            errs[(name, comm, "sdpa")] = _compare(cfg, mesh, comm)
    return errs


def _cp2_tp2_worker(rank, world):
    mesh = init_parallel(tp=2, dp=1, cp=2)
    assert (mesh.tp_rank, mesh.cp_rank) == (rank % 2, rank // 2)
    errs = {}
    for name, extra in (("gpt", {}), ("llama", LLAMA)):
        for comm in ("allgather", "ring"):
            cfg = tiny_config(layers=2, recompute="selective", **extra)
            errs[(name, comm)] = _compare(cfg, mesh, comm)
    saved = _saved_vs_formula(mesh)
    mesh4 = init_parallel(tp=1, dp=1, cp=4)  # the same 4 ranks as one CP group: 8 chunks of 2 tokens
    for name, extra in (("gpt", {}), ("llama", LLAMA)):  # llama: grouped-query attention, 4 heads over 2
        for comm, recompute in (("allgather", "selective"), ("ring", "selective"), ("ring", "full")):
            cfg = tiny_config(layers=2, recompute=recompute, **extra)
            errs[("cp4", name, comm, recompute)] = _compare(cfg, mesh4, comm)
    return errs, saved, {comm: _collectives(mesh4, comm) for comm in ("allgather", "ring")}


def _collectives(mesh, comm: str) -> list[dict]:
    """Calls per collective kind of one forward + backward of a 1-layer and a 2-layer Llama."""
    calls = []
    for layers in (1, 2):
        cfg = tiny_config(layers=layers, recompute="selective", **LLAMA)
        model = GPT(cfg, mesh, seed=7, cp_comm=comm)
        tokens, labels = batch(cfg, b=2, seed=3)
        with count_comm() as counter:
            model(tokens, labels).backward()
        calls.append(dict(counter.calls))
    return calls


def _saved_vs_formula(mesh) -> dict:
    """Bytes the ledger sees one forward keep, over the formula's, per recompute mode (cp=2 x tp=2)."""
    ratios = {}
    for name, extra in (("gpt", {}), ("llama", LLAMA)):
        for recompute in ("none", "selective", "full"):
            cfg = tiny_config(seq_len=64, hidden=128, layers=2, recompute=recompute, **extra)
            model = GPT(cfg, mesh, seed=1)
            tokens, labels = batch(cfg, b=2)
            with ActivationLedger(model) as ledger:
                model(tokens, labels)
            formula = model_activation_bytes(cfg, t=2, micro_batch=2, activation_bytes=4, device="cpu", cp=2)
            ratios[(name, recompute)] = ledger.total() / formula["total"]
    return ratios


def test_cp2_equals_unsplit(tmp_path):
    for errs in run_ranks(_cp2_worker, 2, tmp_path):
        bad = {k: e for k, e in errs.items() if not e <= 1e-5}
        assert not bad, bad


def test_cp2_tp2_and_cp4_equal_unsplit_and_keep_what_the_formula_says(tmp_path):
    for errs, ratios, calls in run_ranks(_cp2_tp2_worker, 4, tmp_path):
        assert sum(1 for k in errs if k[0] == "cp4") == 6
        bad = {k: e for k, e in errs.items() if not e <= 1e-5}
        assert not bad, bad
        off = {k: r for k, r in ratios.items() if not abs(r - 1) <= 0.03}
        assert not off, ratios  # int64 token ids and norm statistics are the rest
        # per layer, exactly the K/V exchange: all-gather, then in backward one more and a
        # reduce-scatter; the ring's 3 cp - 2 steps (cp = 4); outside the layers only the loss and token count
        per_layer = {"allgather": {"all_gather": 2, "reduce_scatter": 1}, "ring": {"send_recv": 10}}
        for comm, (one, two) in calls.items():
            layer = {k: two.get(k, 0) - one.get(k, 0) for k in two.keys() | one.keys()}
            assert {k: n for k, n in layer.items() if n} == per_layer[comm], (comm, one, two)
            outside = {k: n - per_layer[comm].get(k, 0) for k, n in one.items()}
            assert {k: n for k, n in outside.items() if n} == {"all_reduce": 2}, (comm, outside)  # loss, tokens


def test_model_refuses_bad_cp_layouts():
    cfg = tiny_config(seq_len=12)
    mesh = ParallelMesh(1, 1, 0, 0, 0, 4, torch.device("cpu"), cp_size=4)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 x cp = 8"):
        GPT(cfg, mesh)
    mesh2 = ParallelMesh(1, 1, 0, 0, 0, 2, torch.device("cpu"), cp_size=2)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 with parallel.cp=2 is not supported"):
        GPT(tiny_config(attention_dropout=0.1), mesh2)

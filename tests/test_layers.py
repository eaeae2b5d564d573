"""Parallel layers equal dense nn.Linear / F.embedding / F.cross_entropy, in fp64 and fp32."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed_harness import rel_err, tp_group_of
from seqpar.distributed import sync_sp_replicated_grads
from seqpar.distributed.collectives import group_rank
from seqpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy

S, B, H = 8, 3, 16


def _pair_case(t, group, sp, bias, dtype, hidden_out, act):
    """column(H -> hidden_out) -> act -> row(hidden_out -> H) against the dense pair."""
    r = group_rank(group)
    torch.manual_seed(1)
    fc1 = nn.Linear(H, hidden_out, bias=bias, dtype=dtype)
    fc2 = nn.Linear(hidden_out, H, bias=bias, dtype=dtype)
    x = torch.randn(S, B, H, dtype=dtype)
    dy = torch.randn(S, B, H, dtype=dtype)
    # dense
    xd = x.clone().requires_grad_(True)
    yd = fc2(act(fc1(xd)))
    yd.backward(dy)
    # parallel
    col = ColumnParallelLinear.from_dense(fc1, tp_group=group, sequence_parallel=sp)
    row = RowParallelLinear.from_dense(fc2, tp_group=group, sequence_parallel=sp)
    n = S // t
    xp = (x[r * n:(r + 1) * n] if sp else x).clone().requires_grad_(True)
    yp = row(act(col(xp)))
    yp.backward(dy[r * n:(r + 1) * n] if sp else dy)
    holder = nn.ModuleList([col, row])
    sync_sp_replicated_grads(holder, group)
    k, m = hidden_out // t, H
    errs = {
        "out": rel_err(yp, yd[r * n:(r + 1) * n] if sp else yd),
        "dx": rel_err(xp.grad, xd.grad[r * n:(r + 1) * n] if sp else xd.grad),
        "dw1": rel_err(col.weight.grad, fc1.weight.grad[r * k:(r + 1) * k]),
        "dw2": rel_err(row.weight.grad, fc2.weight.grad[:, r * k:(r + 1) * k]),
    }
    if bias:
        errs["db1"] = rel_err(col.bias.grad, fc1.bias.grad[r * k:(r + 1) * k])
        errs["db2"] = rel_err(row.bias.grad, fc2.bias.grad)
    # dense_weight() gathers back the full tensors
    errs["gather_w1"] = rel_err(col.dense_weight(), fc1.weight)
    errs["gather_w2"] = rel_err(row.dense_weight(), fc2.weight)
    assert yp.shape == ((n if sp else S), B, m)
    return errs


def _equivalence(rank, world):
    out = {}
    for t in (1, 2, 4):
        group = tp_group_of(t)
        for sp in (False, True):
            for bias in (False, True):
                for dtype in (torch.float64, torch.float32):
                    out[("mlp", t, sp, bias, dtype)] = _pair_case(t, group, sp, bias, dtype, 4 * H, F.gelu)
                    out[("proj", t, sp, bias, dtype)] = _pair_case(t, group, sp, bias, dtype, 3 * H, torch.tanh)
    return out


def test_column_row_pairs_match_dense_for_t_1_2_4(spawn):
    results = spawn(_equivalence, 4)
    checked = 0
    for rank, res in enumerate(results):
        for (kind, t, sp, bias, dtype), errs in res.items():
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            for name, err in errs.items():
                assert err <= tol, f"rank {rank} {kind} t={t} sp={sp} bias={bias} {dtype}: {name} rel err {err:.2e}"
                checked += 1
    assert checked > 4 * 3 * 2 * 2 * 2 * 2 * 6


def _embedding_ce(rank, world):
    out = {}
    V, Hd = 32, 8
    for t in (1, 2, 4):
        group = tp_group_of(t)
        r = group_rank(group)
        for sp in (False, True):
            torch.manual_seed(3)
            emb = nn.Embedding(V, Hd, dtype=torch.float64)
            ids = torch.randint(0, V, (S, B))  # ids owned by every shard
            dy = torch.randn(S, B, Hd, dtype=torch.float64)
            yd = emb(ids)
            yd.backward(dy)
            pe = VocabParallelEmbedding.from_dense(emb, tp_group=group, sequence_parallel=sp)
            yp = pe(ids)
            n, k = S // t, V // t
            yp.backward(dy[r * n:(r + 1) * n] if sp else dy)
            out[("emb", t, sp)] = {"out": rel_err(yp, yd[r * n:(r + 1) * n] if sp else yd),
                                   "dw": rel_err(pe.weight.grad, emb.weight.grad[r * k:(r + 1) * k]),
                                   "gather": rel_err(pe.dense_weight(), emb.weight)}
        for ls in (0.0, 0.1):
            for dtype in (torch.float64, torch.float32):
                torch.manual_seed(4)
                logits = torch.randn(S, B, V, dtype=dtype)
                targets = torch.randint(0, V, (S, B))
                targets[0, 0] = -100
                targets[3, 1] = -100
                ld = logits.clone().requires_grad_(True)
                lossd = F.cross_entropy(ld.reshape(-1, V), targets.reshape(-1), ignore_index=-100, label_smoothing=ls)
                lossd.backward()
                k = V // t
                lp = logits[..., r * k:(r + 1) * k].clone().requires_grad_(True)
                lossp = vocab_parallel_cross_entropy(lp, targets, tp_group=group, label_smoothing=ls)
                lossp.backward()
                per_tok = vocab_parallel_cross_entropy(logits[..., r * k:(r + 1) * k], targets, tp_group=group,
                                                       label_smoothing=ls, reduction="none")
                ref_tok = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), label_smoothing=ls,
                                          reduction="none").reshape(S, B)
                out[("ce", t, ls, dtype)] = {"loss": rel_err(lossp, lossd),
                                             "dlogits": rel_err(lp.grad, ld.grad[..., r * k:(r + 1) * k]),
                                             "per_token": rel_err(per_tok, ref_tok),
                                             "ignored_zero": float(per_tok[0, 0].abs() + lp.grad[0, 0].abs().sum())}
    return out


def test_embedding_and_cross_entropy_match_torch(spawn):
    for rank, res in enumerate(spawn(_embedding_ce, 4)):
        for key, errs in res.items():
            tol = 1e-5 if torch.float32 in key else 1e-10
            for name, err in errs.items():
                assert err <= tol, f"rank {rank} {key}: {name} err {err:.2e}"


def test_embedding_range_check_compiles_into_one_graph():
    """Ids outside the vocabulary still raise under torch.compile, without a graph break (the eager
    check reads ids.min() on the host, which dynamo cannot trace)."""
    emb = VocabParallelEmbedding(16, 4)
    compiled = torch.compile(emb, backend="eager", fullgraph=True)
    ids = torch.tensor([[0, 15], [3, 7]])
    assert torch.equal(compiled(ids), emb(ids))
    with pytest.raises(RuntimeError, match=r"ids must lie in \[0, 16\)"):
        compiled(torch.tensor([[3, 16]]))
    with pytest.raises(ValueError, match=r"got min 3 max 16"):
        emb(torch.tensor([[3, 16]]))

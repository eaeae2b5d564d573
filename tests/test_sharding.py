"""Parameter layouts (seqpar.sharding): declared once by the layer, used by every consumer.

The fused gate/up layer below is new to seqpar: it only declares its layout, and the dense
state dict, dense<->local conversion and TP-aware clipping are right for it with no other module
edited.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from seqpar.distributed.collectives import group_rank, group_size
from seqpar.distributed.regions import copy_to_tp
from seqpar.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.model import GPT, GPTConfig
from seqpar.sharding import ParamLayout, interleave, mark_sp_replicated, param_layouts, shard, to_dense, to_local
from seqpar.parallel.grads import clip_grad_norm

from distributed_harness import tp_group_of

H, F_ = 8, 12
GATE_UP = ParamLayout(split_dim=0, chunks=2)


def dense_weights():
    g = torch.Generator().manual_seed(7)
    return {"norm.weight": 1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64),
            "gate_up.weight": torch.randn(2 * F_, H, generator=g, dtype=torch.float64),   # [gate; up]
            "down.weight": torch.randn(H, F_, generator=g, dtype=torch.float64)}


class FusedGateUp(nn.Module):
    """SwiGLU's gate and up projections as one column-parallel weight of 2 chunks: rank r holds
    [gate_r; up_r] and returns silu(x gate_r^T) * (x up_r^T), its ffn/t columns."""

    def __init__(self, full: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(shard(full, GATE_UP, group_rank(group), group_size(group)).clone())

    def param_layouts(self) -> dict[str, ParamLayout]:
        return {"weight": GATE_UP}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(copy_to_tp(x, self.group), self.weight).chunk(2, dim=-1)
        return F.silu(gate) * up


class Mlp(nn.Module):
    def __init__(self, dense: dict, group):
        super().__init__()
        self.norm = nn.LayerNorm(H, elementwise_affine=True, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.norm.weight.copy_(dense["norm.weight"])
        self.gate_up = FusedGateUp(dense["gate_up.weight"], group)
        self.down = RowParallelLinear(F_, H, bias=False, tp_group=group, dtype=torch.float64)
        self.down.load_dense(dense["down.weight"])

    def forward(self, x):
        return self.down(self.gate_up(self.norm(x)))


def dense_mlp(w, x):
    gate, up = F.linear(F.layer_norm(x, (H,), w["norm.weight"]), w["gate_up.weight"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w["down.weight"])


def _fused_layer_rank(rank, world):
    group = tp_group_of(world)
    dense = dense_weights()
    model = Mlp(dense, group)
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = model(x)
    (out ** 2).sum().backward()
    params = dict(model.named_parameters())
    gathered = to_dense(model, params, group)
    round_trip = to_local(model, gathered, group)
    grads = to_dense(model, {n: p.grad for n, p in params.items()}, group)
    norm = float(clip_grad_norm(model, 0.5, tp_group=group))
    clipped = to_dense(model, {n: p.grad for n, p in params.items()}, group)
    return dict(out=out.detach(), gathered=gathered, round_trip_ok=all(torch.equal(round_trip[n], params[n].detach())
                                                                      for n in params),
                grads=grads, norm=norm, clipped=clipped, local_shape=tuple(params["gate_up.weight"].shape))


def test_new_fused_layer_round_trips_and_clips_like_the_dense_model(spawn):
    dense = dense_weights()
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = {n: w.clone().requires_grad_() for n, w in dense.items()}
    expected = dense_mlp(ref, x)
    (expected ** 2).sum().backward()
    ref_grads = {n: w.grad.clone() for n, w in ref.items()}
    ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5))
    for t in (1, 2):
        for r, res in enumerate(spawn(_fused_layer_rank, t)):
            assert res["local_shape"] == (2 * F_ // t, H)
            assert res["round_trip_ok"]
            torch.testing.assert_close(res["out"], expected, rtol=1e-12, atol=1e-12)
            for n in dense:
                assert torch.equal(res["gathered"][n], dense[n]), n
                torch.testing.assert_close(res["grads"][n], ref_grads[n], rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(res["clipped"][n], ref[n].grad, rtol=1e-10, atol=1e-12)
            assert res["norm"] == pytest.approx(ref_norm, rel=1e-12)


def test_shard_gives_each_rank_its_rows_of_every_chunk():
    full = torch.arange(12.0).reshape(12, 1)  # 3 chunks of 4 rows
    lay = ParamLayout(split_dim=0, chunks=3)
    assert shard(full, lay, 0, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert shard(full, lay, 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    cols = ParamLayout(split_dim=1)
    assert torch.equal(shard(full.t(), cols, 1, 3), full.t()[:, 4:8])
    assert shard(full, ParamLayout(), 1, 2) is full


def test_interleave_round_trips_on_any_dim():
    x = torch.randn(4, 6, 5)
    for dim in (0, 1):
        for chunks, parts in ((2, 2), (3, 2), (2, 3), (1, 4)):
            if x.shape[dim] % (chunks * parts):
                continue
            y = interleave(x, chunks, parts, dim)
            assert torch.equal(interleave(y, chunks, parts, dim, inverse=True), x)
    # [q; k; v] with 2 heads -> per-head [q0, k0, v0, q1, k1, v1]
    rows = torch.tensor([[0.], [1.], [10.], [11.], [20.], [21.]])
    assert interleave(rows, 3, 2).flatten().tolist() == [0, 10, 20, 1, 11, 21]


def test_layout_and_declaration_errors_name_the_values():
    with pytest.raises(ValueError, match="chunks=2"):
        ParamLayout(chunks=2)
    with pytest.raises(ValueError, match="split_dim=0"):
        ParamLayout(split_dim=0, sp_replicated=True)
    with pytest.raises(ValueError, match=r"t=2 x chunks=3"):
        shard(torch.zeros(9, 2), ParamLayout(split_dim=0, chunks=3), 0, 2)
    with pytest.raises(ValueError, match="nope"):
        mark_sp_replicated(nn.LayerNorm(4), ["nope"])
    with pytest.raises(ValueError, match="chunks"):
        ColumnParallelLinear(4, 6, chunks=4)


def test_layers_declare_their_layouts():
    norm = mark_sp_replicated(nn.LayerNorm(4))
    assert all(lay.sp_replicated for lay in param_layouts(norm).values())
    col = ColumnParallelLinear(4, 6, chunks=3)
    assert param_layouts(col) == {"weight": ParamLayout(0, 3), "bias": ParamLayout(0, 3)}
    row = RowParallelLinear(4, 6)
    assert param_layouts(row) == {"weight": ParamLayout(1), "bias": ParamLayout()}


def test_gpt_keeps_the_callers_config():
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, recompute="selective")
    model = GPT(cfg)
    model.set_recompute("full", "block", 2)
    assert (cfg.recompute, cfg.recompute_method, cfg.recompute_num_layers) == ("selective", "uniform", 1)
    assert model.recompute_modes == ("full", "full") and model.runs == [(0, 1, True), (1, 2, True)]
    assert (model.config.recompute, model.config.recompute_num_layers) == ("selective", 1)  # as built
    assert model.config is not cfg


GQA = ParamLayout(split_dim=0, chunks=(4, 2, 2))  # [q; k; v] with 4 query heads and 2 key/value heads


def _unequal_chunks_rank(rank, world):
    from seqpar.sharding import unshard
    group = tp_group_of(world)
    full = torch.arange(16.0 * 3).reshape(16, 3)
    local = shard(full, GQA, rank, world).clone()
    return local, unshard(local, GQA, group)


def test_unequal_chunks_give_each_rank_its_heads_of_every_block(spawn):
    rows = torch.arange(16.0).reshape(16, 1)  # q rows 0-7, k rows 8-11, v rows 12-15
    assert shard(rows, GQA, 0, 2).flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert shard(rows, GQA, 1, 2).flatten().tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    with pytest.raises(ValueError, match=r"size 12 .*t=4 x chunks=\(4, 2, 2\)"):
        shard(torch.zeros(12, 1), GQA, 0, 4)
    full = torch.arange(16.0 * 3).reshape(16, 3)
    for r, (local, dense) in enumerate(spawn(_unequal_chunks_rank, 2)):
        assert torch.equal(local, shard(full, GQA, r, 2))
        assert torch.equal(dense, full)

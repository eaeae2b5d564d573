"""A TP=2 sequence-parallel MLP forward/backward, checked against the dense result.

    torchrun --nproc-per-node 2 scripts/demo_sp_mlp.py
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import seqpar
from seqpar.distributed import scatter_to_sp, gather_from_sp
from seqpar.layers import ColumnParallelLinear, RowParallelLinear


def main() -> None:
    torch.set_num_threads(1)
    mesh = seqpar.init_parallel(tp=2)
    s, b, h = 16, 4, 64
    torch.manual_seed(0)  # same seed on every rank: same dense weights and inputs
    fc1, fc2 = nn.Linear(h, 4 * h, dtype=torch.float64), nn.Linear(4 * h, h, dtype=torch.float64)
    x = torch.randn(s, b, h, dtype=torch.float64)

    ref_in = x.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(ref_in)))
    ref.sum().backward()

    col = ColumnParallelLinear.from_dense(fc1, tp_group=mesh.tp_group, sequence_parallel=True)
    row = RowParallelLinear.from_dense(fc2, tp_group=mesh.tp_group, sequence_parallel=True)
    inp = x.clone().requires_grad_(True)
    shard = scatter_to_sp(inp, mesh.tp_group)            # [s, b, h] -> [s/t, b, h]
    out = row(F.gelu(col(shard)))                         # [s/t, b, h]
    out.sum().backward()  # each rank's shard of the loss; scatter's backward all-gathers the grad
    full = gather_from_sp(out.detach(), mesh.tp_group)

    err_out = (full - ref).abs().max().item()
    err_grad = (inp.grad - ref_in.grad).abs().max().item()
    if mesh.is_first:
        print(f"{mesh}: sequence-parallel MLP [s={s}, b={b}, h={h}] on {mesh.tp_size} ranks")
        print(f"  max |output - dense| = {err_out:.2e}, max |input grad - dense| = {err_grad:.2e}")
        print("  MATCHES the dense result" if max(err_out, err_grad) < 1e-10 else "  DOES NOT MATCH")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

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


def run(mesh: seqpar.ParallelMesh) -> tuple[float, float]:
    """Max |output - dense| and max |input grad - dense| of the SP MLP on ``mesh``'s TP group."""
    s, b, h = 16, 4, 64
    torch.manual_seed(0)  # same seed on every rank: same dense weights and inputs
    dev = mesh.device  # a GPU under NCCL, the CPU under gloo
    fc1 = nn.Linear(h, 4 * h, dtype=torch.float64).to(dev)
    fc2 = nn.Linear(4 * h, h, dtype=torch.float64).to(dev)
    x = torch.randn(s, b, h, dtype=torch.float64).to(dev)  # drawn on the CPU: the same numbers on every rank

    ref_in = x.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(ref_in)))
    ref.sum().backward()

    col = ColumnParallelLinear.from_dense(fc1, tp_group=mesh.tp_group, sequence_parallel=True, seq_dim=0)
    row = RowParallelLinear.from_dense(fc2, tp_group=mesh.tp_group, sequence_parallel=True, seq_dim=0)
    inp = x.clone().requires_grad_(True)
    shard = scatter_to_sp(inp, mesh.tp_group, seq_dim=0)  # [s, b, h] -> [s/t, b, h]: sequence-first
    out = row(F.gelu(col(shard)))                         # [s/t, b, h]
    out.sum().backward()  # each rank's shard of the loss; scatter's backward all-gathers the grad
    full = gather_from_sp(out.detach(), mesh.tp_group, seq_dim=0)

    err_out = (full - ref).abs().max().item()
    err_grad = (inp.grad - ref_in.grad).abs().max().item()
    if mesh.is_first:
        print(f"{mesh}: sequence-parallel MLP [s={s}, b={b}, h={h}] on {mesh.tp_size} ranks")
        print(f"  max |output - dense| = {err_out:.2e}, max |input grad - dense| = {err_grad:.2e}")
        print("  MATCHES the dense result" if max(err_out, err_grad) < 1e-10 else "  DOES NOT MATCH")
    return err_out, err_grad


def main() -> None:
    torch.set_num_threads(1)
    run(seqpar.init_parallel(tp=2))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Activation memory per layer (t=1, bf16, dropout on) against the paper's Table 2: by the
activation ledger everywhere, by torch.cuda.memory_allocated on CUDA."""
import gc

import torch

from gpt_helpers import batch
from seqpar.distributed import ParallelMesh
from seqpar.memory import ActivationLedger, bytes_per_layer
from seqpar.model import GPT, GPTConfig

from .helpers import sync

TABLE2 = {"none": "tp", "selective": "tp_selective", "full": "full"}  # recompute mode -> Table 2 row at t=1


def activation_bytes(cfg: GPTConfig, mesh: ParallelMesh, tokens: torch.Tensor) -> tuple[int | None, dict[str, int]]:
    """(memory_allocated across one forward on CUDA, else None; the ledger's bytes per layer)."""
    model = GPT(cfg, mesh, seed=0)
    with torch.no_grad():
        model(tokens, tokens)  # fills the per-shape caches (causal mask) outside the measurement
    with ActivationLedger(model) as ledger:
        model(tokens, tokens)
    allocated = None
    if mesh.device.type == "cuda":
        gc.collect()
        sync(mesh.device)
        before = torch.cuda.memory_allocated(mesh.device)
        loss = model(tokens, tokens)
        sync(mesh.device)
        allocated = torch.cuda.memory_allocated(mesh.device) - before
        del loss
    return allocated, ledger.per_layer()


def test_memory(device, shapes, record_row):
    """Ledger within 2% of Table 2 per layer; on CUDA memory_allocated within 5% (the forward at two
    depths, difference over the layers between them, so the embedding and logits terms cancel)."""
    mesh = ParallelMesh.single(device)
    m = shapes.model
    s, b, h, a = m["seq_len"], shapes.batch, m["hidden"], m["heads"]
    tokens = batch(GPTConfig(**m), b)[0].to(mesh.device)
    for mode, technique in TABLE2.items():
        table2 = bytes_per_layer(technique, s=s, b=b, h=h, a=a, t=1)
        measured = {}
        for depth in shapes.depths:
            cfg = GPTConfig(**{**m, "layers": depth}, dropout=0.1, attention_dropout=0.1, recompute=mode,
                            sequence_parallel=False, attention="math", dtype="bfloat16")
            measured[depth] = activation_bytes(cfg, mesh, tokens)
        ledger = [v for _, per_layer in measured.values() for v in per_layer.values()]
        err = max(abs(v - table2) / table2 for v in ledger)
        record_row(f"memory {mode}: ledger per layer vs Table 2 {technique}",
                   f"{max(ledger, key=lambda v: abs(v - table2)):,} B vs {table2:,} B ({err:.2%})", "<= 2%",
                   err <= 0.02)
        if device == "cuda":
            lo, hi = shapes.depths
            per_layer = (measured[hi][0] - measured[lo][0]) / (hi - lo)
            err = abs(per_layer - table2) / table2
            record_row(f"memory {mode}: memory_allocated per layer vs Table 2 {technique}",
                       f"{per_layer:,.0f} B vs {table2:,} B ({err:.2%})", "<= 5%", err <= 0.05)

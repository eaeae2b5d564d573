"""The memory model per attention kernel: what seqpar's math attention, PyTorch's fused sdpa
kernels and sdpa's composite math fallback keep for backward (docs/memory.md), measured on CPU."""
import dataclasses

import pytest
import torch

from seqpar.memory.ledger import ActivationLedger
from seqpar.memory.whole_model import attention_kernel, layer_bytes
from seqpar.model import GPT
from seqpar.model.config import GPTConfig

# configs/memory-demo.yaml's shape on one rank, bf16 activations
DEMO = GPTConfig(vocab_size=512, seq_len=256, hidden=256, heads=8, layers=2, dtype="bfloat16", sequence_parallel=False)
B = 2


def _measured_per_layer(cfg: GPTConfig) -> int:
    net = GPT(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with ActivationLedger(net) as ledger:
        net(tokens, tokens)
    return max(ledger.per_layer().values())


@pytest.mark.parametrize("attention,dropout,kernel", [("math", 0.1, "math"), ("math", 0.0, "math"),
                                                      ("sdpa", 0.1, "sdpa-math"), ("sdpa", 0.0, "fused")])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_measured_bytes_per_layer_match_the_kernels_formula(attention, dropout, kernel, recompute):
    cfg = dataclasses.replace(DEMO, attention=attention, dropout=dropout, attention_dropout=dropout, recompute=recompute)
    assert attention_kernel(cfg, "cpu") == kernel
    formula = layer_bytes(cfg, recompute, s=cfg.seq_len, b=B, t=1, act=2, device="cpu")
    assert _measured_per_layer(cfg) / formula == pytest.approx(1, abs=0.02)


def test_the_kernel_decides_what_selective_recompute_saves():
    math = dataclasses.replace(DEMO, recompute="none")
    fused = dataclasses.replace(math, attention="sdpa")
    dims = dict(s=DEMO.seq_len, b=B, t=1, act=2)
    saved = {k: layer_bytes(c, "none", **dims) - layer_bytes(c, "selective", **dims)
             for k, c in (("math", math), ("fused", fused))}
    scores = DEMO.heads * DEMO.seq_len ** 2 * B
    assert saved["math"] == 5 * scores  # Table 2's 5as^2b
    assert saved["fused"] == 4 * DEMO.heads * DEMO.seq_len * B + 16  # fp32 logsumexp + RNG state, O(s)
    assert attention_kernel(fused, "cuda") == "fused" and attention_kernel(fused, "cpu") == "sdpa-math"

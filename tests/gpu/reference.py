"""The correctness check's reference: a plain GPT written with torch.nn.functional from seqpar's
dense state dict alone, and the comparison of seqpar's loss and gradients with it."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gpt_helpers import batch, loss_and_dense_grads
from seqpar.distributed import ParallelMesh
from seqpar.model import GPT, GPTConfig

from .helpers import Shapes, fp32_exact

Perturb = Callable[[dict[str, torch.Tensor]], None]


def reference_loss(p: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor,
                   cfg: GPTConfig) -> torch.Tensor:
    """Mean cross-entropy of a plain GPT (embeddings + learned positions, pre-LN blocks with fused
    [q; k; v], causal softmax attention, GELU MLP, final LN, tied head) from dense tensors named as
    in ``GPT.dense_state_dict()``. tokens, labels ``[b, s]``; no dropout."""
    b, s = tokens.shape
    h, a, eps = cfg.hidden, cfg.heads, cfg.layernorm_eps
    d = h // a
    gelu = "tanh" if cfg.activation == "gelu_tanh" else "none"
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
    x = F.embedding(tokens, p["wte.weight"]) + p["wpe.weight"][:s]                     # [b, s, h]
    for i in range(cfg.layers):
        w = lambda name: p.get(f"blocks.{i}.{name}")  # noqa: E731 (None for absent biases)
        y = F.layer_norm(x, (h,), w("ln1.weight"), w("ln1.bias"), eps)
        q, k, v = F.linear(y, w("attn.qkv.weight"), w("attn.qkv.bias")).split(h, dim=-1)
        q, k, v = (t.view(b, s, a, d).transpose(1, 2) for t in (q, k, v))           # [b, a, s, d]
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5                                # [b, a, s, s]
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
        x = x + F.linear(ctx, w("attn.proj.weight"), w("attn.proj.bias"))
        y = F.layer_norm(x, (h,), w("ln2.weight"), w("ln2.bias"), eps)
        y = F.gelu(F.linear(y, w("mlp.fc1.weight"), w("mlp.fc1.bias")), approximate=gelu)
        x = x + F.linear(y, w("mlp.fc2.weight"), w("mlp.fc2.bias"))
    x = F.layer_norm(x, (h,), p["ln_f.weight"], p["ln_f.bias"], eps)
    logits = F.linear(x, p.get("lm_head.weight", p["wte.weight"]))                   # [b, s, v]
    return F.cross_entropy(logits.float().reshape(b * s, -1), labels.reshape(-1))


def compare_with_reference(model: GPT, tokens: torch.Tensor, labels: torch.Tensor,
                           perturb: Perturb | None = None) -> dict:
    """seqpar's loss and gradients against :func:`reference_loss` run in fp32 (TF32 off) on the
    model's dense weights (``perturb`` edits those first, in place). A collective under TP.
    Returns the loss relative error, the worst per-tensor ``max|g - g_ref| / max|g_ref|`` and the
    lowest per-tensor gradient cosine, each with the tensor's name."""
    with fp32_exact():
        dense = {k: v.detach().float().clone() for k, v in model.dense_state_dict().items()}
        if perturb is not None:
            perturb(dense)
        params = {k: v.requires_grad_() for k, v in dense.items()}
        ref = reference_loss(params, tokens, labels, model.config)
        ref.backward()
        loss, grads = loss_and_dense_grads(model, tokens, labels)
    max_rel, cos = {}, {}
    for name, q in params.items():
        g, r = grads[name].double(), q.grad.double()
        max_rel[name] = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
        cos[name] = float(F.cosine_similarity(g.flatten(), r.flatten(), dim=0)) if r.norm() > 0 else 1.0
    worst, lowest = max(max_rel, key=max_rel.get), min(cos, key=cos.get)
    ref = float(ref.detach())
    return {"loss_rel": abs(float(loss) - ref) / abs(ref), "grad_max_rel": [max_rel[worst], worst],
            "grad_min_cos": [cos[lowest], lowest]}


def correctness_variants(shapes: Shapes, mesh: ParallelMesh, sp: bool,
                         perturb: Perturb | None = None) -> list[tuple[str, str, dict]]:
    """:func:`compare_with_reference` for fp32 / bf16 x math / sdpa on ``mesh``: (dtype, attention, result)."""
    out = []
    cfg = GPTConfig(**shapes.model)
    tokens, labels = (t.to(mesh.device) for t in batch(cfg, shapes.batch))
    for dtype in ("float32", "bfloat16"):
        for attention in ("math", "sdpa"):
            cfg = GPTConfig(**shapes.model, dropout=0.0, attention_dropout=0.0, recompute="none",
                            sequence_parallel=sp, attention=attention, dtype=dtype)
            model = GPT(cfg, mesh, seed=0)
            out.append((dtype, attention, compare_with_reference(model, tokens, labels, perturb)))
            del model
    return out


def correctness_rows(label: str, dtype: str, res: dict) -> list[tuple[str, str, str, bool]]:
    """(check, measured, threshold, ok) of one :func:`compare_with_reference` result, with its
    dtype's thresholds: fp32 (TF32 off) loss < 1e-5 and gradients < 1e-4 (per tensor, max|g - g_ref|
    / max|g_ref|); bf16 loss < 1e-2 and per-tensor gradient cosine > 0.99."""
    loss_tol = 1e-5 if dtype == "float32" else 1e-2
    rows = [(f"{label}: loss rel err", f"{res['loss_rel']:.2e}", f"< {loss_tol:.0e}", res["loss_rel"] < loss_tol)]
    if dtype == "float32":
        err, name = res["grad_max_rel"]
        return rows + [(f"{label}: grad max rel err", f"{err:.2e} ({name})", "< 1e-04", err < 1e-4)]
    c, name = res["grad_min_cos"]
    return rows + [(f"{label}: min grad cosine", f"{c:.5f} ({name})", "> 0.99", c > 0.99)]

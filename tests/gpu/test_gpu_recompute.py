"""Recomputation replays the exact dropout masks: recompute none / selective / full give
bit-identical loss and gradients with dropout (math attention), and so does sdpa attention with
its own dropout under selective recompute, whose replay runs the forward's attention kernels."""
import re

import torch
from torch.profiler import ProfilerActivity, profile

from gpt_helpers import batch, loss_and_dense_grads
from seqpar.distributed import ParallelMesh
from seqpar.model import GPT, GPTConfig


def test_rng(device, shapes, record_row):
    """Dropout 0.1 in bf16: none / selective / full bit-identical; the none baseline repeats bit for
    bit and dropout is active (train loss != eval loss)."""
    mesh = ParallelMesh.single(device)
    tokens, labels = (t.to(mesh.device) for t in batch(GPTConfig(**shapes.model), shapes.batch))

    def run(mode: str, train: bool = True):
        cfg = GPTConfig(**shapes.model, dropout=0.1, attention_dropout=0.1, recompute=mode,
                        sequence_parallel=False, attention="math", dtype="bfloat16")
        return loss_and_dense_grads(GPT(cfg, mesh, seed=0).train(train), tokens, labels)

    base, eval_loss = run("none"), run("none", train=False)[0]
    record_row("rng: dropout active (train loss != eval loss)", f"{float(base[0]):.6f} vs {float(eval_loss):.6f}",
               "differ", not torch.equal(base[0], eval_loss))
    for mode in ("none", "selective", "full"):
        loss, grads = run(mode)
        bad = ([] if torch.equal(base[0], loss) else ["loss"]) + [k for k in grads if not torch.equal(base[1][k], grads[k])]
        what = "none repeated" if mode == "none" else f"{mode} vs none"
        record_row(f"rng: {what}, bf16, dropout 0.1",
                   "bit-identical" if not bad else f"{len(bad)} tensors differ (first: {bad[0]})", "bit-identical",
                   not bad)


_ATTENTION_NAME = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn.*(attention|sdpa)|sdpa", re.I)


def _attention_kernels(prof) -> list[str]:
    return sorted({e.name for e in prof.events() if _ATTENTION_NAME.search(e.name)})


def test_sdpa(device, record_row):
    """Attention dropout 0.1 and 0.125 (cuDNN's dropout needs multiples of 1/16) under selective
    recompute: gradients bit-identical to no recompute, and the replay runs the forward's attention
    kernel (torch.profiler names, shown in the row)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    dtype = "bfloat16" if device == "cuda" else "float32"
    shape = (dict(vocab_size=512, seq_len=256, hidden=512, heads=8, layers=2) if device == "cuda" else
             dict(vocab_size=128, seq_len=32, hidden=32, heads=4, layers=2))
    tokens = batch(GPTConfig(**shape), 2)[0].to(device)
    for p in (0.1, 0.125):
        grads, names = [], {}
        for mode in ("none", "selective"):
            cfg = GPTConfig(**shape, attention="sdpa", dropout=0.1, attention_dropout=p, recompute=mode, dtype=dtype)
            model = GPT(cfg, ParallelMesh.single(device), seed=0)
            with profile(activities=activities) as fwd:
                loss = model(tokens, tokens)
            with profile(activities=activities) as bwd:
                loss.backward()
            grads.append({n: q.grad for n, q in model.named_parameters()})
            names[mode] = (_attention_kernels(fwd), _attention_kernels(bwd))
        same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
        fwd_names, replay_names = names["selective"]
        replayed = bool(fwd_names) and set(fwd_names) <= set(replay_names)
        record_row(f"sdpa attention dropout {p} under selective recompute vs none",
                   f"{'bit-identical' if same else 'grads differ'}; forward {fwd_names}; "
                   f"replay + backward {replay_names}", "bit-identical, replay runs the forward's kernels",
                   same and replayed)

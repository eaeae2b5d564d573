#!/usr/bin/env python3
"""One asserting validation of seqpar on a GPU, with a CPU smoke mode the test suite runs.

    python scripts/gpu_validate.py                  # one GPU: under 8 minutes on an H200
    python scripts/gpu_validate.py --tp 8           # also the correctness check at t=8 with SP
    python scripts/gpu_validate.py --device cpu     # tiny shapes, every check a CPU can run

Checks, each a row (or a few) of the Markdown table it prints (measured, threshold, PASS/FAIL):

1. correctness: seqpar's GPT against a plain-PyTorch reference written here from the dense state
   dict alone (embeddings + learned positions, pre-LN blocks with fused [q; k; v], causal softmax
   attention, GELU MLP, final LN, tied head, mean cross-entropy), math and sdpa attention. fp32
   with TF32 off: loss relative error < 1e-5, gradients < 1e-4 (per tensor max|g - g_ref| /
   max|g_ref|, worst tensor). bf16 parameters: loss < 1e-2, per-tensor gradient cosine > 0.99,
   against the fp32 reference of the same (bf16-rounded) weights.
2. rng: dropout 0.1 under bf16; recompute none / selective / full give bit-identical loss and
   gradients (same seed, same data); the baseline repeats bit for bit and dropout is active.
3. memory: activation bytes per layer at t=1 in bf16 within 5% of Table 2 (torch.cuda
   .memory_allocated across the forward at two depths, difference / 2, so the embedding and
   logits terms cancel) and within 2% by the activation ledger.
4. throughput: a 1.3B-class GPT (24L, h=2048, a=16, s=2048, bf16 parameters): selective adds at
   most 1.3x the time of re-running every layer's attention core, full / none in [1.2, 1.45], peak
   memory none > selective > full; MFU shown. Compiled blocks (train.compile) at selective: no
   slower than eager, their peak memory and the compilation's seconds shown.
5. launcher: torchrun (NCCL on a GPU, gloo on the CPU) runs the shipped ``tiny-cpu`` config for
   10 steps with dropout and eval, then resumes from its checkpoint to 12 steps.
6. tp (``--tp N``, N > 1): check 1 again on N ranks with tensor + sequence parallelism, against
   the same reference.

7. sdpa (scripts/gpu_runs.py): attention dropout 0.1 and 0.125 (cuDNN's 1/16 steps) under
   selective recompute: gradients bit-identical to no recompute, the replay runs the forward's
   attention kernels (torch.profiler names, printed).
8. resume: 12 steps with dropout checkpointed at 10; resuming at 10 gives steps 11-12 bit for
   bit; on CUDA the checkpoint also resumes on the CPU (streams reseeded, one warning).
9. precision: bf16-autocast within 2% of fp32 over 6 steps.
10. syncs (CUDA): host syncs of a non-logging Trainer step under
    ``torch.cuda.set_sync_debug_mode("warn")``, at most the one ``Trainer.agree`` read.
11. lines: the Trainer's activation and state lines; on CUDA its peak-memory line per log step.
12. async: ``save_checkpoint(async_save=True)`` returns in < 25% of a synchronous save (CUDA).
13. multirank (scripts/gpu_multirank.py): two ranks on the one device over gloo
    (``init_parallel(backend="gloo", device="cuda:0")``): t=2 SP, dp=2 DDP, dp=2 FSDP2, pp=2,
    cp=2 (all-gather and ring), t=2 SP with tp_overlap, and on CUDA t=2 SP and FSDP2 with compiled
    blocks: losses within 1e-4 of t=1 on the same device; t=2 SP with dropout: recompute bit-identical,
    per-TP-rank streams differ; on CUDA pp=2 step time with chunk timing off <= on.

Exits 1 when any row FAILs. ``--device cpu`` runs every check a CPU can with tiny shapes (the
ledger stands in for memory_allocated; timings shown but not asserted; check 6 and 13 on gloo
ranks); what needs CUDA is a SKIP row saying so.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):  # this checkout's seqpar (installed or not) and the helper modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_multirank  # noqa: E402
import gpu_runs  # noqa: E402
from gpu_common import Row, batch, fp32_exact, sync, verdict  # noqa: E402
from gpu_launch import check_launcher, show_failure, subprocess_env, torchrun  # noqa: E402
from gpu_throughput import check_throughput  # noqa: E402
from seqpar.distributed import ParallelMesh, init_parallel, sync_sp_replicated_grads  # noqa: E402
from seqpar.memory import ActivationLedger, bytes_per_layer  # noqa: E402
from seqpar.model import GPT, GPTConfig  # noqa: E402

CHECKS = ("correctness", "rng", "memory", "throughput", "launcher", "tp", "sdpa", "resume", "precision", "syncs",
          "lines", "async", "multirank")
# planned seconds of each check on one H200 (gpu_check.sh's budget is 480 s in all)
PLANNED_S = {"correctness": 15, "rng": 15, "memory": 15, "throughput": 150, "launcher": 35, "tp": 60, "sdpa": 10,
             "resume": 10, "precision": 5, "syncs": 5, "lines": 5, "async": 25, "multirank": 120}
TABLE2 = {"none": "tp", "selective": "tp_selective", "full": "full"}  # recompute mode -> Table 2 row at t=1
Perturb = Callable[[dict[str, torch.Tensor]], None]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model sizes of every check: the GPU run's, or tiny ones for the CPU smoke mode."""

    model: dict            # GPTConfig fields of checks 1, 2, 3 and 6
    batch: int             # sequences per forward in checks 1-3 and 6
    depths: tuple[int, int]  # check 3: layers of the two models whose difference is measured
    big: dict              # GPTConfig fields of check 4
    big_batch: int
    steps: int             # check 4: timed steps per recompute mode (after `warmup`)
    warmup: int
    timeout_s: int         # each torchrun of checks 5 and 6

    @classmethod
    def for_device(cls, device: str) -> "Shapes":
        if device == "cpu":
            tiny = dict(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2)
            return cls(tiny, 2, (2, 4), tiny, 2, steps=2, warmup=1, timeout_s=120)
        model = dict(vocab_size=50304, seq_len=1024, hidden=1024, heads=16, layers=4)
        big = dict(vocab_size=50304, seq_len=2048, hidden=2048, heads=16, layers=24)
        return cls(model, 2, (2, 4), big, 4, steps=8, warmup=3, timeout_s=240)


def table(rows: list[Row]) -> str:
    """The Markdown table of every row."""
    lines = ["| check | measured | threshold | result |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.measured} | {r.threshold} | {r.result} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- reference
def reference_loss(p: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor,
                   cfg: GPTConfig) -> torch.Tensor:
    """Mean cross-entropy of a plain GPT written with torch.nn.functional only, from dense
    tensors named as in ``GPT.dense_state_dict()``. tokens, labels ``[b, s]``; no dropout."""
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


def loss_and_grads(model: GPT, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """seqpar's loss and its gradients in the dense layout (SP-replicated grads summed over TP).
    A collective under TP."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    sync_sp_replicated_grads(model, model.tp_group)
    return loss.detach(), model.to_dense({n: q.grad for n, q in model.named_parameters()})


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
        loss, grads = loss_and_grads(model, tokens, labels)
    max_rel, cos = {}, {}
    for name, q in params.items():
        g, r = grads[name].double(), q.grad.double()
        max_rel[name] = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
        cos[name] = float(F.cosine_similarity(g.flatten(), r.flatten(), dim=0)) if r.norm() > 0 else 1.0
    worst, lowest = max(max_rel, key=max_rel.get), min(cos, key=cos.get)
    ref = float(ref.detach())
    return {"loss_rel": abs(float(loss) - ref) / abs(ref), "grad_max_rel": [max_rel[worst], worst],
            "grad_min_cos": [cos[lowest], lowest]}


def correctness_rows(label: str, dtype: str, res: dict) -> list[Row]:
    """Rows of one :func:`compare_with_reference` result with the thresholds of its dtype."""
    loss_tol = 1e-5 if dtype == "float32" else 1e-2
    rows = [Row(f"{label}: loss rel err", f"{res['loss_rel']:.2e}", f"< {loss_tol:.0e}",
                verdict(res["loss_rel"] < loss_tol))]
    if dtype == "float32":
        err, name = res["grad_max_rel"]
        rows.append(Row(f"{label}: grad max rel err", f"{err:.2e} ({name})", "< 1e-04", verdict(err < 1e-4)))
    else:
        c, name = res["grad_min_cos"]
        rows.append(Row(f"{label}: min grad cosine", f"{c:.5f} ({name})", "> 0.99", verdict(c > 0.99)))
    return rows


def correctness_variants(shapes: Shapes, mesh: ParallelMesh, sp: bool,
                         perturb: Perturb | None = None) -> list[tuple[str, str, dict]]:
    """:func:`compare_with_reference` for fp32 / bf16 x math / sdpa on ``mesh``: (dtype, attention, result)."""
    out = []
    tokens, labels = batch(shapes.model["vocab_size"], shapes.batch, shapes.model["seq_len"], mesh.device)
    for dtype in ("float32", "bfloat16"):
        for attention in ("math", "sdpa"):
            cfg = GPTConfig(**shapes.model, dropout=0.0, attention_dropout=0.0, recompute="none",
                            sequence_parallel=sp, attention=attention, dtype=dtype)
            model = GPT(cfg, mesh, seed=0)
            out.append((dtype, attention, compare_with_reference(model, tokens, labels, perturb)))
            del model
    return out


# ---------------------------------------------------------------------------------- the checks
def check_correctness(device: str, shapes: Shapes, perturb: Perturb | None = None) -> list[Row]:
    """Check 1 at t=1 (``perturb`` edits the reference's weights: the check must then fail)."""
    mesh = ParallelMesh.single(device)
    rows = []
    for dtype, attention, res in correctness_variants(shapes, mesh, sp=False, perturb=perturb):
        rows += correctness_rows(f"correctness t=1 {dtype} {attention}", dtype, res)
    return rows


def check_rng(device: str, shapes: Shapes) -> list[Row]:
    """Check 2: recompute none / selective / full with dropout 0.1 in bf16 give bit-identical
    loss and dense gradients; the none baseline is repeated to show the run is deterministic."""
    mesh = ParallelMesh.single(device)
    tokens, labels = batch(shapes.model["vocab_size"], shapes.batch, shapes.model["seq_len"], mesh.device)

    def run(mode: str, train: bool = True):
        cfg = GPTConfig(**shapes.model, dropout=0.1, attention_dropout=0.1, recompute=mode,
                        sequence_parallel=False, attention="math", dtype="bfloat16")
        model = GPT(cfg, mesh, seed=0).train(train)
        return loss_and_grads(model, tokens, labels)

    def differences(a, b) -> list[str]:
        bad = [] if torch.equal(a[0], b[0]) else ["loss"]
        return bad + [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]

    base = run("none")
    eval_loss = run("none", train=False)[0]
    rows = [Row("rng: dropout active (train loss != eval loss)", f"{float(base[0]):.6f} vs {float(eval_loss):.6f}",
                "differ", verdict(not torch.equal(base[0], eval_loss)))]
    for mode in ("none", "selective", "full"):
        bad = differences(base, run(mode))
        what = "none repeated" if mode == "none" else f"{mode} vs none"
        rows.append(Row(f"rng: {what}, bf16, dropout 0.1", "bit-identical" if not bad else
                        f"{len(bad)} tensors differ (first: {bad[0]})", "bit-identical", verdict(not bad)))
    return rows


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


def check_memory(device: str, shapes: Shapes) -> list[Row]:
    """Check 3: activation bytes per layer (t=1, bf16, dropout on) against Table 2."""
    mesh = ParallelMesh.single(device)
    m = shapes.model
    s, b, h, a = m["seq_len"], shapes.batch, m["hidden"], m["heads"]
    tokens = batch(m["vocab_size"], b, s, mesh.device)[0]
    rows = []
    for mode, technique in TABLE2.items():
        table2 = bytes_per_layer(technique, s=s, b=b, h=h, a=a, t=1)
        measured = {}
        for depth in shapes.depths:
            cfg = GPTConfig(**{**m, "layers": depth}, dropout=0.1, attention_dropout=0.1, recompute=mode,
                            sequence_parallel=False, attention="math", dtype="bfloat16")
            measured[depth] = activation_bytes(cfg, mesh, tokens)
        ledger = [v for _, per_layer in measured.values() for v in per_layer.values()]
        err = max(abs(v - table2) / table2 for v in ledger)
        rows.append(Row(f"memory {mode}: ledger per layer vs Table 2 {technique}",
                        f"{max(ledger, key=lambda v: abs(v - table2)):,} B vs {table2:,} B ({err:.2%})", "<= 2%",
                        verdict(err <= 0.02)))
        lo, hi = shapes.depths
        if measured[hi][0] is None:
            rows.append(Row(f"memory {mode}: memory_allocated per layer", "CUDA only", "<= 5%", "SKIP"))
            continue
        per_layer = (measured[hi][0] - measured[lo][0]) / (hi - lo)
        err = abs(per_layer - table2) / table2
        rows.append(Row(f"memory {mode}: memory_allocated per layer vs Table 2 {technique}",
                        f"{per_layer:,.0f} B vs {table2:,} B ({err:.2%})", "<= 5%", verdict(err <= 0.05)))
    return rows


def check_tp(device: str, shapes: Shapes, tp: int) -> list[Row]:
    """Check 6: check 1 on ``tp`` torchrun ranks with sequence parallelism (``--tp-worker``)."""
    with tempfile.TemporaryDirectory(prefix="seqpar-validate-tp-") as d:
        out = Path(d) / "tp.json"
        proc = torchrun(tp, [str(Path(__file__).resolve()), "--tp-worker", str(out), "--device", device],
                        subprocess_env(device, Path(d)), shapes.timeout_s)
        results = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    if results is None:
        show_failure(f"--tp {tp} ranks", proc)
        return [Row(f"correctness t={tp} SP", f"ranks exited {proc.returncode}", "exit 0", "FAIL")]
    rows = []
    for dtype, attention, res in results:
        rows += correctness_rows(f"correctness t={tp} SP {dtype} {attention}", dtype, res)
    return rows


def tp_worker(out: str, device: str) -> int:
    """One torchrun rank of check 6: every rank runs the comparison, rank 0 writes the results."""
    if device == "cpu":
        torch.set_num_threads(1)  # several ranks share this machine's cores
    mesh = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    if device == "cuda" and mesh.device.type != "cuda":
        raise RuntimeError(f"--tp-worker --device cuda got a mesh on {mesh.device}")
    results = correctness_variants(Shapes.for_device(device), mesh, sp=True)
    if mesh.is_first:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------- main
def run_checks(device: str, tp: int, only: tuple[str, ...]) -> list[Row]:
    """Run the selected checks in order; a check that raises becomes one FAIL row."""
    shapes = Shapes.for_device(device)
    checks = {"correctness": lambda: check_correctness(device, shapes), "rng": lambda: check_rng(device, shapes),
              "memory": lambda: check_memory(device, shapes), "throughput": lambda: check_throughput(device, shapes),
              "launcher": lambda: check_launcher(device, shapes.timeout_s), "tp": lambda: check_tp(device, shapes, tp),
              "multirank": lambda: gpu_multirank.check_multirank(device, Path(__file__).resolve(), shapes.timeout_s)}
    runs = {"sdpa": gpu_runs.check_sdpa_replay, "resume": gpu_runs.check_resume,
            "precision": gpu_runs.check_bf16_autocast, "syncs": gpu_runs.check_host_syncs,
            "lines": gpu_runs.check_memory_lines, "async": gpu_runs.check_async_save}
    rows: list[Row] = []
    for name in only:
        if name == "tp" and tp < 2:
            continue
        done = len(rows)
        if device == "cuda":
            print(f"[{name}: planned ~{PLANNED_S[name]} s on an H200]", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            if name in runs:
                with tempfile.TemporaryDirectory(prefix=f"seqpar-validate-{name}-") as d:
                    rows += runs[name](device, Path(d))
            else:
                rows += checks[name]()
        except Exception as e:  # noqa: BLE001 - reported as a FAIL row, the other checks still run
            import traceback
            traceback.print_exc()
            rows.append(Row(name, f"raised {type(e).__name__}: {str(e)[:200]}".replace("|", "/"), "no error", "FAIL"))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
        for row in rows[done:]:  # as they come: a run cut short by its time limit still shows them
            print(f"[row] {row.check} | {row.measured} | {row.threshold} | {row.result}", file=sys.stderr,
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tp", type=int, default=1, help="also run the correctness check at t=N with SP on N ranks")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--tp-worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--multirank-worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_validate: no CUDA device visible; use --device cpu for the smoke run", file=sys.stderr)
        return 2
    if args.tp_worker:
        return tp_worker(args.tp_worker, args.device)
    if args.multirank_worker:
        return gpu_multirank.worker(args.multirank_worker, args.device)
    only = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = [c for c in only if c not in CHECKS]
    if unknown or args.tp < 1:
        p.error(f"unknown checks {unknown} (choose from {CHECKS})" if unknown else f"--tp must be >= 1, got {args.tp}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke mode, tiny shapes)"
    print(f"seqpar GPU validation on {name}, torch {torch.__version__}", flush=True)
    if args.device == "cuda":
        planned = sum(PLANNED_S[c] for c in only if c != "tp" or args.tp > 1)
        print(f"planned: ~{planned} s on an H200 ({', '.join(f'{c} {PLANNED_S[c]} s' for c in only)})", flush=True)
    t0 = time.perf_counter()
    rows = run_checks(args.device, args.tp, only)
    failed = [r for r in rows if r.result == "FAIL"]
    print("\n" + table(rows))
    print(f"\n{len(rows)} rows, {len(failed)} FAIL, {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The ranks of the two-rank checks (run by ``run_local``; on CUDA both ranks work on ``cuda:0``
over gloo, see staging.py): t=2 SP, dp=2 DDP and FSDP2, pp=2, cp=2, tp_overlap and compiled
blocks, each layout's losses for the comparison with t=1; SP dropout streams per TP rank under
recomputation; on CUDA the pipeline step with chunk timing off and on."""
from __future__ import annotations

import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.distributed import init_parallel, sync_sp_replicated_grads
from seqpar.model import GPT, GPTConfig
from seqpar.parallel import build_pipeline

from .helpers import Shapes
from .staging import host_staged_p2p
from .trainer_runs import run_config, train_losses

STEPS = 4
# name -> (tp, dp, pp, cp, overrides); the global batch is 4 sequences in every case and in the t=1 run
CASES = {
    "t=2 SP": (2, 1, 1, 1, ["parallel.tp=2", "model.sequence_parallel=true"]),
    "dp=2 DDP": (1, 2, 1, 1, ["parallel.dp=2", "parallel.data_parallel=ddp", "train.micro_batch=2"]),
    "dp=2 FSDP2": (1, 2, 1, 1, ["parallel.dp=2", "parallel.data_parallel=fsdp", "train.micro_batch=2"]),
    "pp=2": (1, 1, 2, 1, ["parallel.pp=2", "train.micro_batch=2"]),
    "cp=2 all-gather": (1, 1, 1, 2, ["parallel.cp=2", "parallel.cp_comm=allgather"]),
    "cp=2 ring": (1, 1, 1, 2, ["parallel.cp=2", "parallel.cp_comm=ring"]),
    "t=2 SP tp_overlap": (2, 1, 1, 1, ["parallel.tp=2", "model.sequence_parallel=true", "parallel.tp_overlap=true"]),
    "t=2 SP compiled": (2, 1, 1, 1, ["parallel.tp=2", "model.sequence_parallel=true", "train.compile=true"]),
    "dp=2 FSDP2 compiled": (1, 2, 1, 1, ["parallel.dp=2", "parallel.data_parallel=fsdp", "train.micro_batch=2",
                                         "train.compile=true"]),
}
CUDA_ONLY = ("t=2 SP compiled", "dp=2 FSDP2 compiled")  # Inductor on the CPU: minutes of C++ builds
TIMEOUT = timedelta(minutes=3)  # a rank stuck in a collective fails the run instead of hanging it


def _case(tmp: Path, shapes: Shapes, dev: str, name: str, layout: tuple, overrides: list[str]) -> dict:
    """One layout's losses (and the layout its mesh really has)."""
    tp, dp, pp, cp = layout
    mesh = init_parallel(tp, dp, pp=pp, cp=cp, backend="gloo", device=dev, timeout=TIMEOUT)
    cfg = run_config(tmp, shapes, name.replace(" ", "_").replace("=", ""), overrides)
    return {"losses": train_losses(cfg, mesh), "layout": [mesh.tp_size, mesh.dp_size, mesh.pp_size, mesh.cp_size],
            "device": str(mesh.device)}


def _sp_dropout(dev: str, shapes: Shapes) -> dict:
    """t=2 SP, dropout 0.1: recompute selective / full give this rank's loss and gradients bit for
    bit as none does; the "tp" stream draws differ between TP ranks, the "replicated" ones agree."""
    mesh = init_parallel(2, 1, backend="gloo", device=dev, timeout=TIMEOUT)
    m = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in shapes.run_model)}
    tokens = torch.randint(0, 256, (2, m["seq_len"]), generator=torch.Generator().manual_seed(0)).to(dev)
    out = {}
    for mode in ("none", "selective", "full"):
        cfg = GPTConfig(vocab_size=256, **m, dropout=0.1, attention_dropout=0.1, sequence_parallel=True,
                        recompute=mode)
        model = GPT(cfg, mesh, seed=0)
        loss = model(tokens, tokens)
        loss.backward()
        sync_sp_replicated_grads(model, mesh.tp_group)
        out[mode] = [loss.detach()] + [p.grad for p in model.parameters()]
    same = {mode: all(torch.equal(a, b) for a, b in zip(out["none"], out[mode])) for mode in ("selective", "full")}
    draws = {}
    for name in ("tp", "replicated"):
        with model.rng.fork(name):
            draws[name] = torch.rand(8, device=dev).cpu().tolist()
    gathered = [None, None]
    dist.all_gather_object(gathered, {"same": same, "draws": draws})
    return {"same": {mode: all(r["same"][mode] for r in gathered) for mode in same},
            "tp_differ": gathered[0]["draws"]["tp"] != gathered[1]["draws"]["tp"],
            "replicated_equal": gathered[0]["draws"]["replicated"] == gathered[1]["draws"]["replicated"]}


def _pipeline_timing(dev: str) -> dict:
    """Median step time of pp=2 (1F1B, 4 micro-batches) with the per-chunk CUDA timing off and on."""
    mesh = init_parallel(1, 1, pp=2, backend="gloo", device=dev, timeout=TIMEOUT)
    cfg = GPTConfig(vocab_size=2048, seq_len=512, hidden=512, heads=8, layers=4)
    tokens = torch.randint(0, 2048, (8, 512), generator=torch.Generator().manual_seed(0)).to(dev)
    res = {}
    for on in (False, True, False, True):  # interleaved, so drift hits both alike
        pipe = build_pipeline(cfg, mesh, seed=0, n_microbatches=4, time_cuda=on)
        times = []
        for i in range(5):
            pipe.module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pipe.step(tokens, tokens)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        res.setdefault("on" if on else "off", []).extend(times)
    return {k: statistics.median(v) for k, v in res.items()}


def _guarded(fn):
    """``fn()``, or ``{"error": ...}`` when it raises (the other cases still run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row
        traceback.print_exc()  # on the test's captured output
        return {"error": f"{type(e).__name__}: {e}"[:300].replace("\n", " ")}


def multirank_rank(rank: int, world_size: int, device: str, tmp: str) -> dict:
    """One of the two ranks: every case in turn (the same on both ranks; rank 0's result is used)."""
    dev = "cuda:0" if device == "cuda" else "cpu"
    shapes = Shapes.for_device(device)
    results: dict = {}
    with host_staged_p2p(stage_cpu=True):  # on the CPU too, so that the smoke runs the staging
        for name, (*layout, overrides) in CASES.items():
            if device == "cuda" or name not in CUDA_ONLY:
                results[name] = _guarded(lambda: _case(Path(tmp), shapes, dev, name, tuple(layout), overrides))
        results["sp dropout"] = _guarded(lambda: _sp_dropout(dev, shapes))
        results["pp timing"] = _guarded(lambda: _pipeline_timing(dev)) if device == "cuda" else None
    dist.barrier()
    return results

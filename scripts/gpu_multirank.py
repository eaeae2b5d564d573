"""Two-rank rows of scripts/gpu_validate.py on ONE device: t=2 SP, dp=2 DDP and FSDP2, pp=2, each
against t=1 on the same device; the per-TP-rank dropout streams under SP with recomputation; on
CUDA the pipeline step with timing off vs on.

NCCL refuses two ranks on one GPU, so both ranks join a gloo group and work on ``cuda:0``
(``init_parallel(backend="gloo", device="cuda:0")``): gloo carries CUDA tensors through host
memory for all-reduce, all-gather, all-to-all and broadcast. It has no CUDA send/recv, so the
pipeline's point-to-point transfers are staged through host memory by :func:`host_staged_p2p`
(validation only; torchrun with NCCL, one GPU per rank, needs none of this). On the CPU the same
code runs on plain gloo ranks.

The ranks run under ``torchrun --nproc-per-node 2 scripts/gpu_validate.py --multirank-worker OUT``;
rank 0 writes the results as JSON, the parent compares them with its own t=1 runs.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_common import NEEDS_CUDA, Row, verdict
from gpu_launch import show_failure, subprocess_env, torchrun
from gpu_runs import RUN_MODEL, max_rel, run_config, train_losses
from seqpar.distributed import ParallelMesh, init_parallel, sync_sp_replicated_grads
from seqpar.model import GPT, GPTConfig
from seqpar.parallel import build_pipeline

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


class _Staged:
    """Work handle of a point-to-point transfer staged through host memory: ``wait()`` finishes
    the transfer, then copies a received buffer into its device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor | None):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args) -> bool:
        if self.work is not None:
            self.work.wait(*args)
        if self.target is not None:
            with torch.no_grad():  # pipelining's receive buffers are leaves that require grad
                self.target.copy_(self.host)
            self.target = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


@contextlib.contextmanager
def host_staged_p2p(stage_cpu: bool = False):
    """Inside the block, ``isend`` / ``irecv`` of a non-CPU tensor go through a CPU copy (gloo
    reads and writes host memory only). ``batch_isend_irecv`` and ``P2POp`` see the staged
    functions, so torch's pipelining schedules use them unchanged. ``stage_cpu`` stages CPU
    tensors too (the CPU smoke mode runs the staging that way)."""
    c10d = dist.distributed_c10d
    real_isend, real_irecv = c10d.isend, c10d.irecv

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        if tensor.device.type == "cpu" and not stage_cpu:
            return real_isend(tensor, dst, group, tag, group_dst=group_dst)
        host = tensor.detach().to("cpu", copy=True)  # a blocking copy: the bytes are ready when gloo sends
        return _Staged(real_isend(host, dst, group, tag, group_dst=group_dst), host, None)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if tensor.device.type == "cpu" and not stage_cpu:
            return real_irecv(tensor, src, group, tag, group_src=group_src)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _Staged(real_irecv(host, src, group, tag, group_src=group_src), host, tensor)

    c10d.isend, c10d.irecv, dist.isend, dist.irecv = isend, irecv, isend, irecv
    try:
        yield
    finally:
        c10d.isend, c10d.irecv, dist.isend, dist.irecv = real_isend, real_irecv, real_isend, real_irecv


# ---------------------------------------------------------------------------------- on the ranks
def _sp_dropout(dev: str, device: str) -> dict:
    """t=2 SP, dropout 0.1: recompute selective / full give this rank's loss and gradients bit for
    bit as none does; the "tp" stream draws differ between TP ranks, the "replicated" ones agree."""
    mesh = init_parallel(2, 1, backend="gloo", device=dev, timeout=TIMEOUT)
    shape = RUN_MODEL[device]
    m = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in shape)}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, m["seq_len"]), generator=g).to(dev)
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


def _case(tmp: Path, device: str, dev: str, name: str, layout: tuple, overrides: list[str]) -> dict:
    """One layout's losses (and the layout its mesh really has)."""
    tp, dp, pp, cp = layout
    mesh = init_parallel(tp, dp, pp=pp, cp=cp, backend="gloo", device=dev, timeout=TIMEOUT)
    cfg = run_config(tmp, device, name.replace(" ", "_").replace("=", ""), overrides)
    return {"losses": train_losses(cfg, mesh), "layout": [mesh.tp_size, mesh.dp_size, mesh.pp_size, mesh.cp_size],
            "device": str(mesh.device)}


def _guarded(fn):
    """``fn()``, or ``{"error": ...}`` when it raises (the other checks still run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row
        import traceback
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300].replace("|", "/").replace("\n", " ")}


def worker(out: str, device: str) -> int:
    """One rank of the two-rank checks; rank 0 writes the results to ``out``."""
    if device == "cpu":
        torch.set_num_threads(1)  # both ranks share this machine's cores
    dev = "cuda:0" if device == "cuda" else "cpu"
    tmp = Path(out).parent
    results: dict = {}
    with host_staged_p2p(stage_cpu=True):  # on the CPU too, so that the smoke mode runs the staging
        for name, (*layout, overrides) in CASES.items():
            if device == "cuda" or name not in CUDA_ONLY:
                results[name] = _guarded(lambda: _case(tmp, device, dev, name, tuple(layout), overrides))
        results["sp dropout"] = _guarded(lambda: _sp_dropout(dev, device))
        results["pp timing"] = _guarded(lambda: _pipeline_timing(dev)) if device == "cuda" else None
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------- in the parent
def check_multirank(device: str, script: Path, timeout_s: int) -> list[Row]:
    """The two-rank rows: one torchrun of :func:`worker`, compared with this process's t=1 run."""
    with tempfile.TemporaryDirectory(prefix="seqpar-validate-2ranks-") as d:
        tmp = Path(d)
        reference = train_losses(run_config(tmp, device, "t1", []), ParallelMesh.single(device), STEPS)
        out = tmp / "multirank.json"
        proc = torchrun(2, [str(script), "--multirank-worker", str(out), "--device", device],
                        subprocess_env(device, tmp),
                        timeout_s)
        results = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    where = "both on cuda:0, gloo" if device == "cuda" else "gloo"
    if results is None:
        show_failure("two-rank checks", proc)
        return [Row(f"2 ranks ({where})", f"ranks exited {proc.returncode} (see stderr)", "exit 0", "FAIL")]
    rows = []
    for name, (*layout, _) in CASES.items():
        what = f"2 ranks ({where}): {name} vs t=1, {STEPS} steps fp32"
        if name not in results:
            rows.append(Row(what, NEEDS_CUDA, "< 1e-04", "SKIP"))
            continue
        r = results[name]
        if "error" in r:
            rows.append(Row(what, r["error"], "< 1e-04", "FAIL"))
            continue
        err = max_rel(r["losses"], reference)
        ok = err < 1e-4 and r["layout"] == list(layout)
        rows.append(Row(what, f"max loss rel diff {err:.2e} (tp, dp, pp, cp = {r['layout']} on {r['device']})",
                        "< 1e-04", verdict(ok)))
    sp = results["sp dropout"]
    if "error" in sp:
        return rows + [Row(f"2 ranks ({where}): t=2 SP dropout streams", sp["error"], "no error", "FAIL")]
    for mode, same in sp["same"].items():
        rows.append(Row(f"2 ranks ({where}): t=2 SP dropout 0.1, recompute {mode} vs none",
                        "bit-identical" if same else "differ", "bit-identical", verdict(same)))
    ok = sp["tp_differ"] and sp["replicated_equal"]
    rows.append(Row(f"2 ranks ({where}): SP dropout streams per TP rank",
                    f"tp streams differ {sp['tp_differ']}, replicated equal {sp['replicated_equal']}",
                    "differ, equal", verdict(ok)))
    timing = results["pp timing"]
    if timing is not None and "error" in timing:
        rows.append(Row("pp=2 step time, chunk timing off / on", timing["error"], "<= 1.05", "FAIL"))
    elif timing is None:
        rows.append(Row("pp=2 step time, chunk timing off / on", NEEDS_CUDA, "<= 1.05", "SKIP"))
    else:
        ratio = timing["off"] / timing["on"]
        rows.append(Row("pp=2 step time, chunk timing off / on",
                        f"{timing['off'] * 1e3:.1f} / {timing['on'] * 1e3:.1f} ms = {ratio:.3f}", "<= 1.05",
                        verdict(ratio <= 1.05)))
    return rows

"""Run the peers side by side on ``t`` gloo (or NCCL) ranks and collect per-rank measurements.

Each configuration (system x recompute mode) is built from the same dense weights, its step-0
loss and saved bytes per layer are recorded, then all configurations are timed round-robin
(one step of each per round, a barrier around every step) so machine drift hits them alike.
"""
from __future__ import annotations

import importlib
import os
import queue as queue_mod
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed.collectives import count_comm
from ..model import GPT
from .peer import BenchShape
from ..distributed.mesh import ParallelMesh
from .seqpar_peer import gpt_config

PEERS = {
    "seqpar": "seqpar.bench.seqpar_peer:SeqparPeer",
    "megatron-core": "seqpar.bench.megatron_peer:MegatronPeer",
    "dtensor": "seqpar.bench.dtensor_peer:DTensorPeer",
}


def load_peer(name: str):
    """Instantiate a peer by name; a missing optional package gives a clear ImportError."""
    module, cls = PEERS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as e:
        raise ImportError(f"benchmark peer {name!r} needs an optional package ({e}); "
                          f"install them with: pip install -e '.[bench]'") from e


@dataclass
class Result:
    system: str
    recompute: str
    step0_loss: float
    saved_bytes_per_layer: float
    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _batch(shape: BenchShape, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len), generator=g)
    return tokens, torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len), generator=g)


def measure(shape: BenchShape, systems: list[str], recomputes: list[str], *, repeats: int, warmup: int,
            log=print) -> dict:
    """On every rank of an initialised world (the TP group): build, probe and time every
    configuration. Returns the results plus seqpar's per-step communication (SP vs plain TP)."""
    group, rank, t = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    tokens, labels = _batch(shape, 0)
    reference = GPT(gpt_config(shape, "none"), ParallelMesh.for_tp_group(group), seed=0)
    dense = reference.dense_state_dict()
    comm = {}
    for sp in (True, False):  # seqpar's own traffic per training step: SP against plain TP
        model = GPT(gpt_config(shape, "none", sequence_parallel=sp), ParallelMesh.for_tp_group(group))
        model.load_dense_state_dict(dense)
        with count_comm() as c:
            model(tokens, labels).backward()
        comm["sp" if sp else "tp"] = {"calls": c.calls, "bytes": c.bytes, "wire_bytes": c.wire_bytes(t)}
    del reference
    configs = []
    for system in systems:
        for rc in recomputes:
            peer = load_peer(system)
            peer.build(shape, dense, tp_group=group, tp_rank=rank, tp_size=t, recompute=rc)
            saved = peer.saved_bytes_per_layer(tokens, labels)
            loss0 = peer.step(tokens, labels)
            configs.append((peer, Result(system, rc, loss0, saved, [])))
            if rank == 0:
                log(f"  built {system:<14} recompute={rc:<9} step-0 loss {loss0:.6f}  "
                    f"saved {saved / 2**20:.2f} MiB/layer")
    for i in range(warmup + repeats):
        for peer, res in configs:
            dist.barrier()
            t0 = time.perf_counter()
            peer.step(tokens, labels)
            dist.barrier()
            if i >= warmup:
                res.times.append(time.perf_counter() - t0)
        if rank == 0 and i >= warmup:
            log(f"  round {i - warmup + 1}/{repeats}: " +
                ", ".join(f"{r.system}/{r.recompute} {r.times[-1] * 1e3:.0f} ms" for _, r in configs))
    return {"results": [asdict(r) | {"median": r.median} for _, r in configs], "comm": comm}


def _entry(rank, world, init_file, shape, systems, recomputes, repeats, warmup, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    try:
        out = measure(shape, systems, recomputes, repeats=repeats, warmup=warmup)
        if rank == 0:
            queue.put(out)
    except BaseException as e:  # make the parent fail fast instead of waiting on the queue
        if rank == 0:
            queue.put({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def run_spawned(shape: BenchShape, systems: list[str], recomputes: list[str], *, tp: int, repeats: int,
                warmup: int) -> dict:
    """Start ``tp`` CPU gloo ranks (file:// rendezvous, one thread each) and run :func:`measure`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(r, tp, os.path.join(d, "rdzv"), shape, systems, recomputes,
                                                  repeats, warmup, queue)) for r in range(tp)]
        for p in procs:
            p.start()
        while True:
            try:
                out = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # a rank died: stop the others
                    for p in procs:
                        p.terminate()
                    raise RuntimeError("a benchmark rank failed; see its traceback above")
        for p in procs:
            p.join()
    if "error" in out:
        raise RuntimeError(f"benchmark failed on rank 0: {out['error']}")
    return out

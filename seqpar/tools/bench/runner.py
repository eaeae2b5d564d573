"""Run the peers side by side on ``t`` gloo (or NCCL) ranks and collect per-rank measurements.

Each configuration (system x recompute mode) is built from the same dense weights, its step-0
loss and saved bytes per layer are recorded, then all configurations are timed round-robin
(one step of each per round, a barrier around every step) so machine drift hits them alike.
"""
from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ...distributed.collectives import barrier, group_rank, group_size, world_group
from ...distributed.comm_counter import count_comm
from ...distributed.local import run_local
from ...model import GPT
from .peer import BenchShape
from ...distributed.mesh import ParallelMesh
from .seqpar_peer import gpt_config

COLLECTIVE_TIMEOUT_S = 300  # a rank stuck in a collective fails the run instead of hanging it

PEERS = {
    "seqpar": "seqpar.tools.bench.seqpar_peer:SeqparPeer",
    "seqpar-overlap": "seqpar.tools.bench.seqpar_peer:OverlapPeer",
    "seqpar-compiled": "seqpar.tools.bench.seqpar_peer:CompiledPeer",
    "megatron-core": "seqpar.tools.bench.megatron_peer:MegatronPeer",
    "dtensor": "seqpar.tools.bench.dtensor_peer:DTensorPeer",
    "plain": "seqpar.tools.bench.plain_peer:PlainPeer",  # one device: --tp 1, recompute none / full
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
    group = world_group()
    rank, t = group_rank(group), group_size(group)
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
            barrier(world_group())
            t0 = time.perf_counter()
            peer.step(tokens, labels)
            barrier(world_group())
            if i >= warmup:
                res.times.append(time.perf_counter() - t0)
        if rank == 0 and i >= warmup:
            log(f"  round {i - warmup + 1}/{repeats}: " +
                ", ".join(f"{r.system}/{r.recompute} {r.times[-1] * 1e3:.0f} ms" for _, r in configs))
    return {"results": [asdict(r) | {"median": r.median} for _, r in configs], "comm": comm,
            "gemm_flops": gemm_rate(shape, t)}


def gemm_rate(shape: BenchShape, t: int, repeats: int = 20) -> float:
    """This rank's measured fp32 GEMM rate (FLOP/s) at the step's largest GEMM, ``[b s, h] x
    [h, 4h/t]``, all ranks at once as in the step (median of ``repeats``)."""
    a = torch.randn(shape.micro_batch * shape.seq_len, shape.hidden)
    w = torch.randn(shape.hidden, 4 * shape.hidden // t)
    times = []
    for _ in range(repeats + 2):
        barrier(world_group())
        t0 = time.perf_counter()
        torch.mm(a, w)
        times.append(time.perf_counter() - t0)
    return 2 * a.shape[0] * a.shape[1] * w.shape[1] / statistics.median(times[2:])


def _rank_measure(rank: int, world: int, shape: BenchShape, systems: list[str], recomputes: list[str],
                  repeats: int, warmup: int) -> dict:
    """One rank of :func:`run_spawned`: the world is the TP group."""
    return measure(shape, systems, recomputes, repeats=repeats, warmup=warmup)


def run_spawned(shape: BenchShape, systems: list[str], recomputes: list[str], *, tp: int, repeats: int,
                warmup: int) -> dict:
    """Start ``tp`` CPU gloo ranks (:func:`~seqpar.distributed.local.run_local`, one thread each) and run
    :func:`measure`; rank 0's results. A failing rank raises its error with its traceback."""
    return run_local(_rank_measure, tp, shape, systems, recomputes, repeats, warmup, timeout=None,
                     collective_timeout=COLLECTIVE_TIMEOUT_S)[0]

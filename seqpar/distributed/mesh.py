"""Process groups: a ``pp x dp x cp x tp`` mesh over torch's DeviceMesh.

Ranks are laid out tp-fastest, then cp, then dp, then pp: global rank ``r`` has ``tp_rank = r %
tp``, ``cp_rank = (r // tp) % cp``, ``dp_rank = (r // (tp * cp)) % dp`` and ``pp_rank = r //
(tp * cp * dp)``, so a TP group is ``tp`` consecutive ranks (one node on a GPU cluster, where
NVLink carries the per-layer all-gathers and reduce-scatters), a CP group (context parallelism:
each rank holds ``s/cp`` of every sequence) the next dimension out, and a pipeline stage is
``dp * cp * tp`` consecutive ranks.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import UserError

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelMesh:
    """Who this rank is in the ``pp x dp x tp`` layout, and the groups to talk to its peers.

    ``tp_group`` / ``dp_group`` / ``pp_group`` / ``cp_group`` are ``None`` when that dimension
    has size 1, so layers built with them are plain single-rank layers. ``device_mesh`` is
    torch's ``DeviceMesh`` with dims ``("pp", "dp", "cp", "tp")`` (``None`` for a mesh built
    without one): FSDP2 shards over ``dp`` (x ``cp``), checkpoints describe tensors on it.
    """

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    device_mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh ("pp", "dp", "cp", "tp")
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    # expert parallelism, carved from dp x cp: dp rank x cp + cp rank = edp_rank * ep + ep_rank (expert_parallel())
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None    # the ranks whose experts together make all experts
    edp_group: dist.ProcessGroup | None = None   # the ranks holding the same experts (dp / ep of them)

    @property
    def edp_size(self) -> int:
        """Expert-data-parallel size: dp x cp / ep ranks hold the same experts."""
        return self.dp_size * self.cp_size // self.ep_size

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """The group that reduces expert gradients: ``edp_group`` under ep > 1, else dp's."""
        return self.edp_group if self.ep_size > 1 else self.dp_group

    @property
    def dp_mesh(self):
        """The 1-D ``DeviceMesh`` over this rank's dp group (FSDP2 shards over it)."""
        if self.device_mesh is None:
            raise ValueError("this ParallelMesh was built without a DeviceMesh; build it with init_parallel()")
        return self.device_mesh["dp"]

    @property
    def dp_cp_mesh(self):
        """The 1-D ``DeviceMesh`` over this rank's dp x cp ranks (FSDP2 with context parallelism:
        the cp ranks hold the same parameters, so they shard them too); ``dp_mesh`` when cp = 1."""
        if self.cp_size == 1:
            return self.dp_mesh
        return self.device_mesh["dp", "cp"]._flatten("dp_cp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """The process group over this rank's dp x cp ranks (``dp_group`` when cp = 1; ``None`` when
        dp x cp = 1): the ranks whose gradients are summed over cp and averaged over dp, at once."""
        if self.cp_size == 1:
            return self.dp_group
        if self.dp_size == 1:
            return self.cp_group
        return self.dp_cp_mesh.get_group()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelMesh":
        """A one-rank mesh that needs no process group (notebooks, plain scripts)."""
        return cls(1, 1, 0, 0, 0, 1, torch.device(device))

    @classmethod
    def for_tp_group(cls, tp_group: dist.ProcessGroup | None, device: str | torch.device = "cpu") -> "ParallelMesh":
        """A TP-only mesh around an existing group (tests, benchmarks, callers that made their own
        groups): ``dp = 1``, TP rank and size read from ``tp_group``."""
        from .collectives import group_rank, group_size
        t = group_size(tp_group)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(tp_size=t, dp_size=1, tp_rank=group_rank(tp_group), dp_rank=0, rank=rank, world_size=t,
                   device=torch.device(device), tp_group=tp_group if t > 1 else None)

    @property
    def is_first(self) -> bool:
        """True on global rank 0, the rank that prints and writes shared files."""
        return self.rank == 0

    def __repr__(self) -> str:
        pp = f"pp={self.pp_rank}/{self.pp_size}, " if self.pp_size > 1 else ""
        pp += f"cp={self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else ""
        pp += f"ep={self.ep_rank}/{self.ep_size}, " if self.ep_size > 1 else ""
        return (f"ParallelMesh(rank={self.rank}/{self.world_size}, {pp}tp={self.tp_rank}/{self.tp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, device={self.device})")


def validate_layout(tp: int, dp: int | None, world_size: int, pp: int = 1, cp: int = 1) -> int:
    """Check ``pp * dp * cp * tp == world_size`` (inferring ``dp`` when ``None``); return ``dp``.

    Pure arithmetic: every rank raises the same error before any collective is issued.
    """
    if cp != 1:
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise UserError(f"cp must be a positive integer, got cp={cp!r}")
        return _validate_with_cp(tp, dp, world_size, pp, cp)
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {name}={value!r}")
    if dp is None:
        if world_size % (tp * pp) != 0:
            what = f"tp={tp}" if pp == 1 else f"pp x tp = {pp} x {tp} = {pp * tp}"
            raise UserError(f"world size {world_size} is not divisible by {what}; "
                            f"{'pp * ' if pp > 1 else ''}dp * tp must equal the world size")
        return world_size // (tp * pp)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise UserError(f"dp must be a positive integer, got dp={dp!r}")
    if pp * dp * tp != world_size:
        if pp == 1:
            raise UserError(f"dp * tp must equal the world size: dp={dp} x tp={tp} = {dp * tp}, "
                            f"world size = {world_size}")
        raise UserError(f"pp * dp * tp must equal the world size: pp={pp} x dp={dp} x tp={tp} = "
                        f"{pp * dp * tp}, world size = {world_size}")
    return dp


def _validate_with_cp(tp: int, dp: int | None, world_size: int, pp: int, cp: int) -> int:
    """:func:`validate_layout` with context parallelism: ``pp * dp * cp * tp == world_size``."""
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {name}={value!r}")
    fixed = pp * cp * tp
    if dp is None:
        if world_size % fixed:
            raise UserError(f"world size {world_size} is not divisible by pp x cp x tp = {pp} x {cp} x {tp} = "
                            f"{fixed}; pp * dp * cp * tp must equal the world size")
        return world_size // fixed
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise UserError(f"dp must be a positive integer, got dp={dp!r}")
    if dp * fixed != world_size:
        raise UserError(f"pp * dp * cp * tp must equal the world size: pp={pp} x dp={dp} x cp={cp} x tp={tp} = "
                        f"{dp * fixed}, world size = {world_size}")
    return dp


def _restart_scoped_store(world_size: int, timeout: timedelta) -> dict:
    """Under torchrun the workers share the agent's TCPStore across restarts, and the default
    process group's keys are not scoped by restart: a restarted rank can read a dead peer's
    address and fail to connect. Scoping the keys by ``TORCHELASTIC_RESTART_COUNT`` avoids it."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dict(store=dist.PrefixStore(f"seqpar/restart{restart}", store), rank=int(os.environ["RANK"]),
                world_size=world_size)


MIXED_BACKEND = "cpu:gloo,cuda:nccl"


def _choose_backend(backend: str | None) -> str:
    """The existing group's backend, else ``backend``, else the mixed one on CUDA and gloo on CPU."""
    if dist.is_initialized():
        return str(dist.get_backend())
    if backend is not None:
        return backend
    return MIXED_BACKEND if torch.cuda.is_available() else "gloo"


def _rank_device(backend: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when ``backend`` uses NCCL, else the CPU. Raises
    (before any group exists) when this node starts more ranks than it has GPUs."""
    if "nccl" not in backend:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"backend {backend!r} needs CUDA, but no GPU is visible to this process")
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world > gpus or local_rank >= gpus:
        raise UserError(f"LOCAL_WORLD_SIZE={local_world} ranks on this node (LOCAL_RANK={local_rank}) but only "
                        f"{gpus} GPU(s) are visible: NCCL needs one GPU per rank. Start at most {gpus} "
                        f"processes per node (torchrun --nproc-per-node {gpus}) or check CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _explicit_device(device: str | torch.device, backend: str) -> torch.device:
    """``init_parallel(device=...)``: this rank's device as given. A CUDA device is made current
    (and CUDA initialised) first, so DeviceMesh keeps it instead of picking ``cuda:LOCAL_RANK``."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"init_parallel(device={str(device)!r}) needs CUDA, but no GPU is visible to this process")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.cuda.init()
    elif backend == "nccl":
        raise UserError(f"init_parallel(device={str(device)!r}) with backend {backend!r}: NCCL needs CUDA devices")
    return device


def _init_default_group(backend: str, device: torch.device, world_size: int, rank: int | None,
                        init_method: str | None, timeout: timedelta) -> None:
    """The default process group: torchrun's store (scoped by restart), or ``init_method``."""
    kwargs: dict = dict(backend=backend, timeout=timeout)
    if init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs.update(_restart_scoped_store(world_size, timeout))
    elif init_method is not None:
        kwargs.update(init_method=init_method, rank=rank if rank is not None else int(os.environ.get("RANK", "0")),
                      world_size=world_size)
    if device.type == "cuda" and "nccl" in backend:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


def _check_sizes(**sizes) -> None:
    """``init_parallel``'s sizes are ints (``dp``, ``rank``, ``world_size``: or None), sizes >= 1."""
    for name, value in sizes.items():
        if value is None and name in ("dp", "rank", "world_size"):
            continue
        low = 0 if name == "rank" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"init_parallel({name}={value!r}): {name} must be an int >= {low}"
                            + (" or None" if name in ("dp", "rank", "world_size") else ""))


def init_parallel(tp: int = 1, dp: int | None = None, *, pp: int = 1, cp: int = 1, rank: int | None = None,
                  world_size: int | None = None, init_method: str | None = None,
                  backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                  device: str | torch.device | None = None) -> ParallelMesh:
    """Initialise (if needed) the default process group and build the ``pp x dp x cp x tp`` mesh.

    Under torchrun, ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` come from the environment.
    Tests pass ``rank``, ``world_size`` and a ``file://`` ``init_method`` explicitly. With no
    environment, no explicit world and ``tp == dp == 1`` (or ``dp`` None) a one-rank mesh is
    returned without any process group. Backend: ``"cpu:gloo,cuda:nccl"`` when CUDA is available
    (CUDA tensors over NCCL; small host-side scalars still work over gloo), else gloo; an
    already-initialised group keeps its backend (a gloo group on a GPU machine stays on CPU).
    ``timeout`` bounds every collective, so a dead peer fails the job instead of hanging it.

    ``device`` overrides the rank's device. ``backend="gloo", device="cuda:0"`` puts every rank
    on one GPU, which NCCL refuses: gloo carries CUDA tensors through host memory for the
    collectives it supports (all-reduce, all-gather, all-to-all, broadcast; its reduce-scatter is
    an all-reduce) but not for send/recv. Slow; it exists so that one GPU can run the multi-rank
    paths (tests/gpu/test_gpu_multirank.py), not for training.
    """
    _check_sizes(tp=tp, dp=dp, pp=pp, cp=cp, rank=rank, world_size=world_size)
    launched = dist.is_initialized() or "WORLD_SIZE" in os.environ or world_size is not None
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if not launched and tp * pp * cp > 1:
        n = tp * pp * cp * (dp or 1)
        extra = (f", pp={pp}" if pp > 1 else "") + (f", cp={cp}" if cp > 1 else "")
        raise UserError(f"init_parallel(tp={tp}{extra}) needs {n} processes, but this is a single process started "
                        f"without torchrun: start it with `torchrun --nproc-per-node {n} SCRIPT.py` (or "
                        f"`seqpar train ... --nproc-per-node N`)")
    dp = validate_layout(tp, dp, world_size, pp, cp)
    backend = _choose_backend(backend)
    device = _rank_device(backend) if device is None else _explicit_device(device, backend)

    if world_size == 1 and not dist.is_initialized() and init_method is None and "MASTER_ADDR" not in os.environ:
        return ParallelMesh.single(device)

    if not dist.is_initialized():
        _init_default_group(backend, device, world_size, rank, init_method, timeout)

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    return _parallel_mesh(mesh, world_size, device)


def expert_parallel(mesh: ParallelMesh, ep: int) -> ParallelMesh:
    """``mesh`` with an ``ep`` dimension carved from dp x cp: the rank at dp rank ``d`` and cp rank
    ``c`` has data index ``i = d cp + c`` and is expert-parallel rank ``i % ep`` of
    expert-data-parallel rank ``i // ep`` (the ep ranks of a group are neighbours, CP ranks first).
    Builds every rank's ep and edp groups (``new_group`` is collective: every rank calls this, with
    the same ``ep``)."""
    if ep == mesh.ep_size:
        return mesh
    dp, cp, tp = mesh.dp_size, mesh.cp_size, mesh.tp_size
    if (dp * cp) % ep:
        raise UserError(f"parallel.ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp}")
    from .collectives import new_group
    data, edp = dp * cp, dp * cp // ep
    mine: dict[str, dist.ProcessGroup | None] = {"ep": None, "edp": None}
    for pp in range(mesh.pp_size):
        for t in range(tp):
            rank = lambda i: (pp * data + i) * tp + t  # noqa: E731 - data index i = dp rank x cp + cp rank
            for e in range(edp):
                ranks = [rank(e * ep + j) for j in range(ep)]
                group = new_group(ranks)
                mine["ep"] = group if mesh.rank in ranks else mine["ep"]
            for j in range(ep):
                ranks = [rank(e * ep + j) for e in range(edp)]
                group = new_group(ranks) if edp > 1 else None
                mine["edp"] = group if mesh.rank in ranks else mine["edp"]
    index = mesh.dp_rank * cp + mesh.cp_rank
    return dataclasses.replace(mesh, ep_size=ep, ep_rank=index % ep, ep_group=mine["ep"], edp_group=mine["edp"])


def destroy_parallel() -> None:
    """Destroy the default process group (and the mesh's groups with it), if one is initialised."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _parallel_mesh(mesh, world_size: int, device: torch.device) -> ParallelMesh:
    """This rank's :class:`ParallelMesh` of a ``("pp", "dp", "cp", "tp")`` DeviceMesh."""
    size = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    rank = {name: mesh.get_local_rank(name) for name in size}
    group = {name: mesh.get_group(name) if size[name] > 1 else None for name in size}
    return ParallelMesh(tp_size=size["tp"], dp_size=size["dp"], tp_rank=rank["tp"], dp_rank=rank["dp"],
                        rank=dist.get_rank(), world_size=world_size, device=device, tp_group=group["tp"],
                        dp_group=group["dp"], pp_size=size["pp"], pp_rank=rank["pp"], pp_group=group["pp"],
                        device_mesh=mesh, cp_size=size["cp"], cp_rank=rank["cp"], cp_group=group["cp"])

"""FSDP2 over dp composed with TP + SP: same training as ddp and as one rank, state sharded as the
formula says, SP-replicated gradients summed over TP once, and sharded checkpoints that reshard
to any layout without any rank gathering another's shard."""
import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from seqpar import init_parallel
from seqpar.cli import main
from seqpar.config import load_run_config
from seqpar.memory.state import state_bytes_formula
from seqpar.sharding import local_tensor, sp_replicated_parameters
from seqpar.train import Trainer
from seqpar.checkpoint import complete_checkpoints

from run_helpers import SHARDED_RUN, run_overrides

STEPS = 20


RUN = {**SHARDED_RUN, "model.layers": 2, "train.steps": STEPS, "train.eval_interval": 0}


def _trainer(tmp: Path, tp: int, **extra) -> Trainer:
    return Trainer(load_run_config(None, run_overrides(tmp, RUN, parallel__tp=tp, **extra)), mesh=init_parallel(tp=tp))


def _curve(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    try:
        out = []
        for step in range(steps):
            m = trainer.train_step(step)
            out.append((m.loss, m.grad_norm))
        return out
    finally:
        trainer.close()


def _sp_grads(trainer: Trainer, every: bool = False) -> dict[str, torch.Tensor]:
    """This rank's part of every SP-replicated gradient (``every``: of every gradient) after one
    step's backward and reductions."""
    trainer.engine.forward_backward(trainer.micro_batches(0))  # the engine reduces the grads too
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    params = list(trainer.model.parameters()) if every else sp_replicated_parameters(trainer.model)
    out = {names[id(p)]: local_tensor(p.grad).clone() for p in params}
    trainer.close()
    return out


def _layouts(rank, world, tmp):
    tmp = Path(tmp)
    out = {"state": {}}
    for mode in ("ddp", None):  # None: data_parallel defaults to fsdp when dp > 1
        tr = _trainer(tmp, 2, **({"parallel__data_parallel": mode} if mode else {}))
        out["default_mode" if mode is None else "ddp_mode"] = tr.run.dp_mode
        out[tr.run.dp_mode] = _curve(tr, STEPS)
        out["state"][tr.run.dp_mode] = tr.state  # measured on the tensors after the first step
    for name, extra in {"full_keep": dict(model__recompute="full", parallel__reshard_after_forward=False),
                        "none": dict(model__recompute="none"),
                        "bf16": dict(train__precision="bf16"),
                        "bf16_autocast": dict(train__precision="bf16-autocast")}.items():
        out[name] = _curve(_trainer(tmp, 2, **extra), 4)
    out["sp_grads"] = _sp_grads(_trainer(tmp, 2))
    out["rank"] = (dist.get_rank() % 2, dist.get_rank() // 2)  # (tp rank, dp rank)
    return out


def _reference(rank, world, tmp):
    tmp = Path(tmp)
    return _curve(_trainer(tmp, 1), STEPS), _sp_grads(_trainer(tmp, 1), every=True)


def _close(a, b, tol):
    return all(abs(x[0] - y[0]) <= tol and abs(x[1] - y[1]) <= tol * max(1.0, abs(y[1])) for x, y in zip(a, b))


def test_fsdp_trains_like_ddp_and_one_rank_with_half_the_state(spawn, tmp_path):
    ref, ref_grads = spawn(_reference, 1, str(tmp_path))[0]
    res = spawn(_layouts, 4, str(tmp_path))
    r0 = res[0]
    assert r0["default_mode"] == "fsdp"
    assert len(r0["fsdp"]) == STEPS and _close(r0["fsdp"], r0["ddp"], 1e-4) and _close(r0["fsdp"], ref, 1e-4)
    assert ref[-1][0] < ref[0][0], "the loss falls"
    for name in ("full_keep", "none"):
        assert _close(r0[name], ref[:4], 1e-4), name
    for name in ("bf16", "bf16_autocast"):  # bf16 compute: close to fp32, not equal
        assert _close(r0[name], ref[:4], 5e-2) and r0[name] != ref[:4], name
    # every rank reports the same losses
    assert all(r["fsdp"] == r0["fsdp"] for r in res)
    # state: measured on the tensors, fsdp about half of ddp at dp=2, equal to the formula
    cfg = load_run_config(None, run_overrides(tmp_path, RUN, parallel__tp=2)).model
    for mode in ("ddp", "fsdp"):
        measured = r0["state"][mode]
        formula = state_bytes_formula(cfg, t=2, dp=2, data_parallel=mode)
        for key in ("parameters", "gradients", "optimizer"):
            assert abs(measured[key] - formula[key]) <= 0.02 * formula[key], (mode, key, measured, formula)
    assert sum(r0["state"]["fsdp"].values()) <= 0.55 * sum(r0["state"]["ddp"].values())
    # SP-replicated grads: bit-identical on the two TP ranks of a dp rank, equal to the t=1 grads
    by_rank = {r["rank"]: r["sp_grads"] for r in res}
    assert by_rank[(0, 0)], "the model has SP-replicated parameters"
    for dp_rank in (0, 1):
        a, b = by_rank[(0, dp_rank)], by_rank[(1, dp_rank)]
        assert all(torch.equal(a[n], b[n]) for n in a)
        for n, g in a.items():
            rows = g.shape[0]
            full = ref_grads[n]
            torch.testing.assert_close(g, full[dp_rank * rows:(dp_rank + 1) * rows], rtol=1e-4, atol=1e-6)


SMALLEST = 8  # the smallest parameter has 16 elements (a norm of h=16); flags and counts have 1


class _FloatCollectives:
    """Records every tensor collective's floating-point payload of at least ``SMALLEST`` elements
    (DCP's own collectives carry pickled plans as uint8; a parameter or a moment, or a piece of
    one, travelling between ranks would be float)."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
             "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv")

    def __init__(self):
        self.seen: list[tuple[str, tuple]] = []

    @contextlib.contextmanager
    def active(self):
        saved = []
        for mod in (dist, c10d):
            for name in self.NAMES:
                fn = getattr(mod, name)
                saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(name, fn))
        try:
            yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if torch.is_tensor(t) and t.is_floating_point() and t.numel() >= SMALLEST:
                        self.seen.append((name, tuple(t.shape)))
            return fn(*args, **kwargs)
        return wrapper


def _checkpoints(rank, world, tmp):
    tmp = Path(tmp)
    out = {}
    tr = _trainer(tmp, 2, checkpoint__resume="auto", train__steps=6)
    try:
        for step in range(3):
            tr.train_step(step)
        with _FloatCollectives().active() as rec:
            tr.checkpoints.save(3)
        out["save_floats"] = rec.seen
        out["ref"] = [tr.train_step(step).loss for step in range(3, 6)]
    finally:
        tr.close()
    for tp, mode in ((1, "fsdp"), (4, "ddp")):
        tr = _trainer(tmp, tp, checkpoint__resume="auto", train__steps=6, parallel__data_parallel=mode)
        try:
            with _FloatCollectives().active() as rec:
                start = (tr.checkpoints.resume() or 0)
            out[(tp, mode)] = (start, rec.seen, [tr.train_step(step).loss for step in range(start, 6)])
        finally:
            tr.close()
    # a background save: training goes on, the checkpoint is sealed by the next save or close()
    tmp.joinpath("async").mkdir(exist_ok=True)
    tr = _trainer(tmp / "async", 2, checkpoint__resume="never", train__steps=4, checkpoint__async=True)
    try:
        tr.train_step(0)
        tr.checkpoints.save(1)
        out["pending"] = [p.name for p in complete_checkpoints(tmp / "async" / "ckpt")]
        tr.train_step(1)
        tr.checkpoints.save(2)  # seals step 1 first
        out["after_second"] = [p.name for p in complete_checkpoints(tmp / "async" / "ckpt")]
    finally:
        tr.close()
    out["after_close"] = [p.name for p in complete_checkpoints(tmp / "async" / "ckpt")]
    return out


def test_sharded_checkpoints_reshard_to_any_layout_without_gathering(spawn, tmp_path):
    res = spawn(_checkpoints, 4, str(tmp_path))
    for r in res:
        assert r["save_floats"] == [], f"a tensor went between ranks during save: {r['save_floats'][:3]}"
        for key in ((1, "fsdp"), (4, "ddp")):
            start, floats, losses = r[key]
            assert start == 3 and floats == [], (key, floats[:3])
            assert max(abs(a - b) for a, b in zip(losses, r["ref"])) <= 1e-4, (key, losses, r["ref"])
        assert r["pending"] == [] and r["after_second"] == ["step_00000001"]
        assert r["after_close"] == ["step_00000001", "step_00000002"]
    # the sharded checkpoint exports to one dense file (one tensor at a time) and generates
    ckpt = complete_checkpoints(tmp_path / "ckpt")[-1]
    assert main(["export", str(ckpt), str(tmp_path / "export"), "--format", "safetensors"]) == 0
    from seqpar.checkpoint.safetensors import read_safetensors
    tensors = read_safetensors(tmp_path / "export" / "model.safetensors")
    assert tensors["wte.weight"].shape == (64, 16) and tensors["blocks.0.attn.qkv.weight"].shape == (48, 16)
    assert all(math.isfinite(float(t.abs().sum())) for t in tensors.values())
    from safetensors.torch import load_file  # the format others read
    assert all(torch.equal(v, tensors[k]) for k, v in load_file(str(tmp_path / "export" / "model.safetensors")).items())


def test_memory_cli_prints_state_per_rank(capsys):
    assert main(["memory", "gpt-1.3b", "--tp", "8", "--dp", "8", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    ddp = next(line for line in out.splitlines() if line.startswith("| 8 | ddp |"))
    fsdp = next(line for line in out.splitlines() if line.startswith("| 8 | fsdp |"))
    total = lambda line: float(line.split("|")[6].split()[0])  # noqa: E731
    assert abs(total(fsdp) * 8 - total(ddp)) <= 0.01 * total(ddp)

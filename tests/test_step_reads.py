"""The Trainer's step reads nothing on the host unless it logs: under fused AdamW the non-finite skip
stays on the device (``found_inf``), the loss, grad norm and skip count are read at the next logging
step, the stop flag one step late without draining the queue; the bf16 recipe's fp32 master grads
are cast by multi-tensor copies, equal bit for bit to a cast per parameter."""
import math
import os
import signal

import pytest
import torch

import seqpar.train.trainer as trainer_module
from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh
from seqpar.model.vocab import check_token_ids
from seqpar.parallel.precision import Precision
from seqpar.train import Trainer
from seqpar.tools.host_reads import HostReads
from seqpar.train.faults import NonFiniteError
from seqpar.train.optim import build_optimizer

from run_helpers import TINY_MODEL, run_overrides

RUN = {**TINY_MODEL, "model.heads": 2, "model.layers": 1, "model.dropout": 0.0, "model.attention_dropout": 0.0,
       "train.precision": "bf16", "train.micro_batch": 1, "train.global_batch": 2, "train.steps": 8,
       "train.log_interval": 4, "train.eval_interval": 0, "train.warmup_steps": 1, "checkpoint.interval": 0}


def test_the_counter_sees_every_kind_of_read():
    t = torch.ones(3)
    for read in (lambda: t.tolist(), lambda: t[0].item(), lambda: float(t[0]), lambda: bool(t[0] > 0),
                 lambda: t.numpy()):
        with HostReads() as counter:
            read()
        assert len(counter.reads) == 1, counter.reads
    with HostReads() as counter:
        torch.stack([t, t]).sum(0).mul_(2)
        check_token_ids(t.long(), 8)  # a CPU-only guard on the input batch
    assert counter.reads == []


def _fused_adamw(model, **kwargs):
    """The Trainer's AdamW groups under the fused kernel (the CUDA default) on the CPU."""
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in build_optimizer(model, **kwargs).param_groups]
    return torch.optim.AdamW(groups, lr=kwargs["lr"], betas=kwargs["betas"], fused=True)


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr(trainer_module, "build_optimizer", _fused_adamw)


def _trainer(tmp_path, **settings) -> Trainer:
    return Trainer(load_run_config(None, run_overrides(tmp_path, {**RUN, **settings})), mesh=ParallelMesh.single())


def _counted_steps(trainer: Trainer, steps) -> list[list[str]]:
    counts = []
    for step in steps:
        with HostReads() as counter:
            trainer.train_step(step)
        counts.append(counter.reads)
    return counts


def test_a_step_that_does_not_log_reads_nothing(tmp_path, fused):
    """bf16 recipe, 2 micro-batches, fused AdamW: steps 2-3 read nothing, step 4 (logging) reads
    the flags of steps 2-4 at once; the losses are the ones a read every step gives."""
    trainer = _trainer(tmp_path)
    try:
        assert trainer.optimizer.defaults["fused"]
        first = trainer.train_step(0)  # the first step measures activations and state: not counted
        counts = _counted_steps(trainer, (1, 2, 3))
    finally:
        trainer.close()
    assert counts[:2] == [[], []], counts
    assert counts[2] == ["tolist"], counts
    assert math.isfinite(first.loss)


def test_lazy_reads_change_no_number(tmp_path, fused):
    """The same run read every step (log_interval 1) and every 4 steps: equal losses and weights."""
    runs = {}
    for interval in (1, 4):
        trainer = _trainer(tmp_path / str(interval), **{"train.log_interval": interval})
        try:
            metrics = [trainer.train_step(s) for s in range(8)]
            runs[interval] = ([m.loss for m in metrics], [m.grad_norm for m in metrics],
                              [p.detach().clone() for p in trainer.model.parameters()])
        finally:
            trainer.close()
    assert runs[1][:2] == runs[4][:2]
    assert all(torch.equal(a, b) for a, b in zip(runs[1][2], runs[4][2]))


def _poison(trainer: Trainer, steps: set[int]) -> None:
    """Optimizer steps ``steps`` (from 0) get NaN gradients (fp32: the hook is on a parameter the
    forward uses, not a master behind bf16 copies)."""
    current = {"step": -1}
    next(trainer.model.parameters()).register_hook(
        lambda g: torch.full_like(g, float("nan")) if current["step"] in steps else g)
    run = trainer.train_step

    def train_step(step):
        current["step"] = step
        return run(step)
    trainer.train_step = train_step


def test_skip_on_the_device_is_counted_at_the_next_logging_step(tmp_path, fused):
    trainer = _trainer(tmp_path, **{"train.nonfinite_grads": "skip", "train.precision": "fp32"})
    params = list(trainer.model.parameters())
    try:
        _poison(trainer, {1})
        trainer.train_step(0)
        before = [p.detach().clone() for p in params]
        with HostReads() as counter:
            skipped = trainer.train_step(1)
        assert counter.reads == [] and trainer.history["skipped"] == [], "nothing read before the logging step"
        assert all(torch.equal(a, p) for a, p in zip(before, params)), "the skipped step left the weights alone"
        trainer.train_step(2)
        assert trainer.history["skipped"] == [] and not torch.equal(before[0], params[0])
        trainer.train_step(3)  # logs: reads steps 2-4
        assert trainer.history["skipped"] == [2] and skipped.skipped and math.isnan(skipped.grad_norm)
        state = trainer.optimizer.state[params[0]]
        assert float(state["step"]) == 3, "AdamW counted the 3 steps it took, not the skipped one"
    finally:
        trainer.close()


def test_stop_on_the_device_names_the_step_and_keeps_its_weights(tmp_path, fused):
    """Under train.nonfinite_grads=stop the run stops at the next logging step, naming step 2, with
    the weights from before step 2: the clean step 3 did not update them either."""
    trainer = _trainer(tmp_path, **{"train.precision": "fp32"})
    params = list(trainer.model.parameters())
    try:
        _poison(trainer, {1})
        trainer.train_step(0)
        before = [p.detach().clone() for p in params]
        trainer.train_step(1)
        trainer.train_step(2)
        with pytest.raises(NonFiniteError, match=r"non-finite gradients .* at step 2; stopping"):
            trainer.train_step(3)
        assert all(torch.equal(a, p) for a, p in zip(before, params))
    finally:
        trainer.close()


def test_a_signal_between_logging_steps_stops_one_step_later(tmp_path, fused):
    """SIGTERM before step 2 (not a logging step): its flag is read at step 3, which checkpoints."""
    trainer = _trainer(tmp_path, **{"train.steps": 12, "train.log_interval": 10})
    run = trainer.train_step

    def train_step(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return run(step)
    trainer.train_step = train_step
    history = trainer.fit()
    assert history["steps"] == [1, 2, 3] and history["checkpoint"].endswith("step_00000003")
    assert len(history["losses"]) == 3 and all(math.isfinite(x) for x in history["losses"])


def _signal_on_rank_1(rank, world, overrides):
    """dp=2, fused AdamW: rank 1 alone receives SIGTERM before step 2 (no logging step)."""
    from seqpar import init_parallel
    trainer_module.build_optimizer = _fused_adamw
    trainer = Trainer(load_run_config(None, overrides), mesh=init_parallel(tp=1, dp=2))
    run = trainer.train_step

    def train_step(step):
        if step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return run(step)
    trainer.train_step = train_step
    history = trainer.fit()
    return history["steps"], history["checkpoint"], history["losses"]


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(spawn, tmp_path):
    overrides = run_overrides(tmp_path, {**RUN, "train.steps": 12, "train.log_interval": 10,
                                         "train.global_batch": 4, "train.precision": "fp32"})
    r0, r1 = spawn(_signal_on_rank_1, 2, overrides)
    assert r0 == r1 and r0[0] == [1, 2, 3] and r0[1].endswith("step_00000003"), (r0, r1)


def _accumulate_per_parameter(model, weights):
    """The recipe before multi-tensor casts: one cast or add per parameter."""
    for name, p in model.named_parameters():
        g = weights[name].grad
        if g is not None:
            p.grad = g.to(torch.float32) if p.grad is None else p.grad.add_(g)


def test_multi_tensor_master_grads_equal_per_parameter_casts(monkeypatch):
    from seqpar.model import GPT, GPTConfig
    import seqpar.parallel.precision as precision
    monkeypatch.setattr(precision, "SCRATCH_BYTES", 4096)  # several chunks, one tensor larger than a chunk
    grads = {}
    for how in ("foreach", "loop"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2), seed=0)
        prec = Precision("bf16", torch.device("cpu"))
        weights = prec.compute_weights(model)
        assert all(w.dtype == torch.bfloat16 and torch.equal(w, p.detach().to(torch.bfloat16))
                   for w, p in zip(weights.values(), model.parameters()))
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, 16), generator=gen)
            with prec.weights_in(model, weights):
                model(tokens, tokens).backward()
            (prec.accumulate if how == "foreach" else _accumulate_per_parameter)(model, weights)
            if how == "loop":
                for w in weights.values():
                    w.grad = None
        grads[how] = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads["foreach"])
    assert all(torch.equal(a, b) for a, b in zip(grads["foreach"], grads["loop"]))

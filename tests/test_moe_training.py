"""The shipped moe-tiny-cpu config trains on 4 CPU ranks at ep=2 x tp=2 (SP), and on 2 pipeline stages
with ep=2, with the losses of one process (the bf16 recipe too, to bf16's precision), logs each MoE
layer's tokens per expert, and writes a checkpoint one process loads."""
import torch

from run_helpers import run_overrides

TINY = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 32, "model.layers": 4,
        "model.moe.ffn_hidden": 32, "train.steps": 3, "train.micro_batch": 2, "train.global_batch": 4,
        "train.log_interval": 1, "train.eval_interval": 0, "train.warmup_steps": 1, "checkpoint.interval": 0}


def _train(rank, world, overrides, tp, pp=1, losses_only=False):
    """fp32 losses, log lines and checkpoint; then the bf16 recipe's losses (its gradient buckets,
    the experts' over edp). With ``pp > 1`` or ``losses_only``: the fp32 losses and log lines only."""
    from seqpar import init_parallel
    from seqpar.config import load_run_config
    from seqpar.train.trainer import Trainer
    trainer = Trainer(load_run_config("moe-tiny-cpu", overrides), mesh=init_parallel(tp=tp, pp=pp))
    if pp > 1 or losses_only:
        return trainer.fit()["losses"], trainer.engine.log_lines()
    history = trainer.fit()
    bf16 = [*overrides, "train.precision=bf16", "train.steps=2", "checkpoint.interval=0", "checkpoint.resume=never",
            f"checkpoint.dir={history['checkpoint']}-bf16"]
    low = Trainer(load_run_config("moe-tiny-cpu", bf16), mesh=init_parallel(tp=tp)).fit()["losses"]
    return history["losses"], trainer.engine.log_lines(), history["checkpoint"], low


def test_moe_tiny_cpu_trains_at_ep2_tp2_with_the_losses_of_one_process(spawn, tmp_path):
    one = spawn(_train, 1, run_overrides(tmp_path, TINY, ckpt="one"), 1)[0]
    four = spawn(_train, 4, run_overrides(tmp_path, {**TINY, "parallel.tp": 2, "parallel.ep": 2}, ckpt="four"), 2)
    losses, lines, checkpoint, bf16 = four[0]
    assert len(bf16) == 2 and all(abs(a - b) < 2e-2 for a, b in zip(bf16, one[3])), (bf16, one[3])
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, one[0])) and len(losses) == 3, (losses, one[0])
    assert lines == one[1] and [line.split(":")[0].strip() for line in lines] == [f"moe blocks.{i}" for i in (1, 2, 3)]
    assert "tokens per expert min" in lines[0]
    # the ep x tp checkpoint holds every expert under its dense name: one process loads it
    from seqpar.checkpoint.save_load import load_model_only
    from seqpar.config import load_run_config
    from seqpar.model import GPT
    cfg = load_run_config("moe-tiny-cpu", run_overrides(tmp_path, TINY))
    a, b = GPT(cfg.model), GPT(cfg.model)
    load_model_only(checkpoint, a)
    load_model_only(one[2], b)
    da, db = a.dense_state_dict(), b.dense_state_dict()
    assert max(float((da[k] - db[k]).abs().max()) for k in db) < 1e-5
    assert not torch.equal(da["blocks.1.mlp.experts.w1"][0], da["blocks.1.mlp.experts.w1"][3])
    # pipeline stages holding MoE layers with their experts split over ep=2 of dp=2 (pp=2, 1F1B over
    # each rank's 2 micro-batches of 1 sequence): the losses and loads of one process at micro_batch=1
    # (the balancing loss is per micro-batch); the first stage logs its MoE layer's load
    single = {**TINY, "train.micro_batch": 1}
    one_mb1 = spawn(_train, 1, run_overrides(tmp_path, single, ckpt="one-mb1"), 1, 1, True)[0]
    piped, stage_lines = spawn(_train, 4, run_overrides(tmp_path, {**single, "parallel.pp": 2, "parallel.ep": 2},
                                                        ckpt="pp"), 1, 2)[0]
    assert all(abs(a - b) < 1e-5 for a, b in zip(piped, one_mb1[0])) and len(piped) == 3, (piped, one_mb1[0])
    assert stage_lines[-1].split(":")[1] == one_mb1[1][0].split(":")[1], (stage_lines, one_mb1[1])

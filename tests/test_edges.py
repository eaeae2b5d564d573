"""Edges a user meets first: a t=2 script started with plain python, the caller's Hugging Face
config left alone by attention checkpointing, sampling from a padded vocabulary."""
import pytest
import torch

import seqpar
from seqpar.model import GPT, GPTConfig
from seqpar.train.generate import sample


def test_a_parallel_script_started_without_torchrun_says_how_to_start_it(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2"):
        seqpar.init_parallel(tp=2)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 4"):
        seqpar.init_parallel(tp=2, pp=2)
    assert seqpar.init_parallel(tp=1).world_size == 1  # one process needs no launcher


def test_checkpoint_attention_leaves_the_callers_config_alone():
    transformers = pytest.importorskip("transformers")
    from seqpar.dropin import checkpoint_attention
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    before = model(input_ids=ids, labels=ids).loss
    checkpoint_attention(model)
    assert config._attn_implementation == "eager", "the caller's config object was changed"
    assert model.config is not config and model.config._attn_implementation != "eager"
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, before)


def test_sampling_from_a_padded_vocabulary_draws_the_unpadded_models_tokens():
    base = dict(vocab_size=50, seq_len=16, hidden=16, heads=2, layers=1, dropout=0.0, attention_dropout=0.0)
    plain, padded = GPT(GPTConfig(**base), seed=1), GPT(GPTConfig(**base, vocab_multiple=64), seed=1)
    assert padded.padded_vocab == 64 and plain.padded_vocab == 50
    for name, w in plain.dense_state_dict().items():
        assert torch.equal(w, padded.dense_state_dict()[name]), name
    for seed in range(3):
        a = sample(plain, [1, 2, 3], 10, temperature=1.0, top_k=0, seed=seed)
        b = sample(padded, [1, 2, 3], 10, temperature=1.0, top_k=0, seed=seed)
        assert a == b and max(a) < 50


def test_the_trainer_resolves_recompute_auto_under_its_budget(tmp_path):
    import numpy as np

    from seqpar.config import load_run_config
    from seqpar.distributed.mesh import ParallelMesh
    from seqpar.train import Trainer
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16))
    base = ["model.vocab_size=64", "model.seq_len=16", "model.hidden=16", "model.heads=2", "model.layers=4",
            f"data.source={tmp_path / 'tokens.npy'}", "train.steps=1", "train.micro_batch=2", "train.eval_interval=0",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}", "model.recompute=auto"]
    trainer = Trainer(load_run_config(None, base + ["train.memory_budget_gib=80"]), mesh=ParallelMesh.single())
    try:
        modes = trainer.model.config.recompute_layers
        assert modes is not None and len(modes) == 4 and set(modes) <= {"none", "selective", "full"}
        assert modes == ("none",) * 4  # 80 GiB holds everything: nothing to recompute
        assert np.isfinite(trainer.train_step(0).loss)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"memory_budget_gib"):
        load_run_config(None, base)


def test_a_pipeline_rank_builds_only_its_layers_with_the_same_weights():
    from seqpar.model.gpt import NotBuilt
    cfg = GPTConfig(vocab_size=50, seq_len=16, hidden=16, heads=2, layers=4, dropout=0.0, attention_dropout=0.0)
    full, part = GPT(cfg, seed=5), GPT(cfg, seed=5, build_layers={2, 3})
    assert all(isinstance(part.blocks[i], NotBuilt) and not list(part.blocks[i].parameters()) for i in (0, 1))
    whole = dict(full.named_parameters())
    for name, p in part.named_parameters():  # every layer built here equals the unsplit model's
        assert torch.equal(p, whole[name]), name
    assert {n.split(".")[1] for n, _ in part.named_parameters() if n.startswith("blocks.")} == {"2", "3"}
    with pytest.raises(RuntimeError, match="layer 0 is not built on this rank"):
        part(torch.zeros(1, 8, dtype=torch.long))

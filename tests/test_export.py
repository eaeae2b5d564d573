"""``seqpar export CHECKPOINT OUT --format hf`` and ``seqpar import HF_DIR CHECKPOINT_DIR``: folders
``transformers`` loads, checkpoints the trainer resumes and ``seqpar generate`` samples, for GPT-2 and Llama."""
import contextlib
import io
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpar.cli import main as seqpar  # noqa: E402
from seqpar.config import dump, load_run_config  # noqa: E402
from seqpar.distributed.mesh import ParallelMesh  # noqa: E402
from seqpar.model import GPT, GPTConfig  # noqa: E402
from seqpar.train import Trainer  # noqa: E402
from seqpar.checkpoint import load_model_only, save_checkpoint  # noqa: E402
from seqpar.interop.export import family_of  # noqa: E402
from seqpar.train.optim import build_optimizer  # noqa: E402

V, S = 97, 16
LLAMA = dict(vocab_size=V, seq_len=S, hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=48, norm="rmsnorm",
             position="rope", mlp="swiglu", bias=False, tie_embeddings=False, rope_theta=500000.0, init_std=0.1)
GPT2 = dict(vocab_size=V, seq_len=S, hidden=32, heads=4, layers=2, activation="gelu_tanh", init_std=0.1)


def _ids():
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(_ids())[..., :V]


def _checkpoint(tmp_path, fields) -> tuple[GPT, object]:
    cfg = load_run_config(None, [f"model.{k}={v}" for k, v in fields.items()] + ["model.dropout=0.0",
                                                                                   "model.attention_dropout=0.0"])
    model = GPT(cfg.model, seed=1)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    save_checkpoint(tmp_path / "ckpt", 5, model, opt, {}, dump(cfg), model.rng)
    return model, cfg


@pytest.mark.parametrize("fields", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, fields):
    model, cfg = _checkpoint(tmp_path, fields)
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "model.safetensors"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.config.vocab_size == V and type(hf).__name__ == json.loads((tmp_path / "hf/config.json").read_text())[
        "architectures"][0]
    with torch.no_grad():
        got = hf(input_ids=_ids()).logits
    assert (got - _logits(model)).abs().max() <= 1e-5 * _logits(model).abs().max()
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert next(half.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(w.float(), hf.state_dict()[n].to(torch.bfloat16).float())
               for n, w in half.state_dict().items())


def _hf_folder(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                                       tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg)
    else:  # GPT-2's own vocabulary, tiny otherwise
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, n_positions=S, n_embd=16,
                                                                  n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path / "hf")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "def", "x", "(", ")", ":", "return"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    return hf.eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_then_resume_generate_and_export_back(tmp_path, kind):
    hf = _hf_folder(tmp_path, kind)
    ids = _ids() % 7
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert seqpar(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "train.micro_batch=2",
                       "model.recompute=none", f"out_dir={tmp_path / 'run'}"]) == 0
    step0 = tmp_path / "ckpt" / "step_00000000"
    cfg = load_run_config(step0 / "config.yaml")
    assert cfg.checkpoint.dir == str(tmp_path / "ckpt") and cfg.model.recompute == "none"
    assert family_of(cfg.model) == kind and (step0 / "tokenizer.json").is_file()
    model = GPT(cfg.model)
    load_model_only(step0, model)
    model.eval()
    with torch.no_grad():
        assert (model(ids)[..., :expected.shape[-1]] - expected).abs().max() <= 1e-5 * expected.abs().max()
    # the trainer resumes from it (any data with ids below the vocabulary) and steps
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 7, 4000).astype(np.uint16))
    run = load_run_config(step0 / "config.yaml", [f"data.source={tmp_path / 'tokens.npy'}", "train.steps=1",
                                                   "train.eval_interval=0"])
    trainer = Trainer(run, mesh=ParallelMesh.single())
    try:
        assert (trainer.checkpoints.resume() or 0) == 0
        assert all(torch.equal(w, model.dense_state_dict()[n]) for n, w in trainer.model.dense_state_dict().items())
        assert np.isfinite(trainer.train_step(0).loss)
    finally:
        trainer.close()
    with contextlib.redirect_stdout(out):
        assert seqpar(["generate", str(tmp_path / "ckpt"), "--prompt", "def x", "--tokens", "3"]) == 0
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    assert out.getvalue().count("def x") == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert all(torch.equal(w, hf.state_dict()[n]) for n, w in back.state_dict().items())
    # seqpar's own dense file: the same tensors under seqpar's names, and `seqpar generate` reads it
    samples = {}
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "dense"), "--format", "safetensors"]) == 0
    for name in ("ckpt", "dense"):
        samples[name] = io.StringIO()
        with contextlib.redirect_stdout(samples[name]):
            assert seqpar(["generate", str(tmp_path / name), "--prompt", "def x", "--tokens", "3"]) == 0
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "dense" / "model.safetensors"))) == set(model.dense_state_dict())
    assert all(torch.equal(w, model.dense_state_dict()[n])
               for n, w in load_file(str(tmp_path / "dense" / "model.safetensors")).items())
    assert samples["dense"].getvalue() == samples["ckpt"].getvalue() and "def x" in samples["dense"].getvalue()


def test_export_force_replaces_an_earlier_export_of_either_format(tmp_path, capsys):
    model, _ = _checkpoint(tmp_path, GPT2)
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", ckpt, str(out)]) == 0
    assert seqpar(["export", ckpt, str(out), "--format", "safetensors"]) == 2  # holds files: refused
    assert "--force" in capsys.readouterr().err
    (out / "tokenizer.json").write_text("{}")  # another checkpoint's, left by an earlier export
    (out / "notes.txt").write_text("mine")  # not an export's file: kept
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", ckpt, str(out), "--format", "safetensors", "--force"]) == 0
    assert {p.name for p in out.iterdir()} == {"config.yaml", "model.safetensors", "notes.txt"}
    from safetensors.torch import load_file
    assert set(load_file(str(out / "model.safetensors"))) == set(model.dense_state_dict())
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", ckpt, str(out), "--force"]) == 0  # and back to Hugging Face's format
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "notes.txt"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = hf.eval()(input_ids=_ids()).logits
    assert (got - _logits(model)).abs().max() <= 1e-5 * _logits(model).abs().max()


def test_refusals(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"no Hugging Face family has this model: \{'norm': 'rmsnorm', 'position': "
                                         r"'learned'"):
        family_of(GPTConfig(norm="rmsnorm"))
    _hf_folder(tmp_path, "llama")
    with contextlib.redirect_stdout(io.StringIO()):
        seqpar(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    capsys.readouterr()
    assert seqpar(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2  # one line, exit code 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert seqpar(["import", str(tmp_path), str(tmp_path / "other")]) == 2
    assert "is not a Hugging Face model folder" in capsys.readouterr().err

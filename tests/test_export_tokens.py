"""A Hugging Face export carries the special tokens of the checkpoint's tokenizer: ``AutoTokenizer`` on
the folder has its eos token, ``config.json`` / ``generation_config.json`` hold ids inside the
vocabulary, and ``generate`` stops at end of text; for GPT-2 and Llama, imported and trained here."""
import contextlib
import io
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpar.checkpoint import save_checkpoint  # noqa: E402
from seqpar.cli import main as seqpar  # noqa: E402
from seqpar.config import dump, load_run_config  # noqa: E402
from seqpar.model import GPT  # noqa: E402
from seqpar.train.optim import build_optimizer  # noqa: E402

V, S = 96, 16
WORDS = ["<|endoftext|>", "<s>", "</s>", "<unk>", "def", "x", "(", ")", ":", "return"]
LLAMA = dict(vocab_size=V, seq_len=S, hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=48, norm="rmsnorm",
             position="rope", mlp="swiglu", bias=False, tie_embeddings=False)
GPT2 = dict(vocab_size=V, seq_len=S, hidden=32, heads=4, layers=2, activation="gelu_tanh")


def _tokenizer(path, words=WORDS):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _favour_eos(model, eos: int) -> None:
    """Make greedy decoding pick ``eos`` after any prompt: the last hidden state made one vector for
    every input, and eos's output row aligned with it."""
    with torch.no_grad():
        base = model.base_model
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight", "c_proj.bias", "wpe.weight")):
                p.zero_()
        emb = model.get_input_embeddings().weight
        if getattr(base, "ln_f", None) is not None:  # GPT-2: tied output, the final norm's bias is the state
            base.ln_f.weight.zero_()
            base.ln_f.bias.copy_(emb[eos] / emb[eos].norm())
            emb[eos] *= 50
            return
        emb.copy_(emb[0].expand_as(emb))
        h = base.norm(emb[:1])[0]
        model.lm_head.weight[eos] = 50 * h / h.norm() ** 2


def _generates_until_eos(folder) -> dict:
    """Load ``folder`` with the Auto classes, make eos likely, generate greedily; what came out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert tok.eos_token is not None and tok.eos_token_id == model.config.eos_token_id < model.config.vocab_size
    assert model.generation_config.eos_token_id == tok.eos_token_id
    _favour_eos(model, tok.eos_token_id)
    prompt = tok("def x", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    return {"eos": tok.eos_token_id, "bos": model.config.bos_token_id, "new": out[0, prompt.shape[1]:].tolist(),
            "warned": [str(w.message) for w in caught if "token_id" in str(w.message)]}


def _trained_checkpoint(tmp_path, fields) -> None:
    """A checkpoint as `seqpar train` writes it with a tokenizer seqpar trained (no origin file)."""
    cfg = load_run_config(None, [f"model.{k}={v}" for k, v in fields.items()])
    model = GPT(cfg.model, seed=1)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, {}, dump(cfg), model.rng,
                    attachments={"tokenizer.json": _tokenizer(tmp_path / "tokenizer.json")})


def _imported_checkpoint(tmp_path, kind) -> None:
    """`seqpar import` of a tiny Hugging Face folder whose config's ids are its tokenizer's (GPT-2:
    the library's default 50256, outside the vocabulary, so the tokenizer's end-of-text wins)."""
    torch.manual_seed(0)
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=S, tie_word_embeddings=False, bos_token_id=0,
            eos_token_id=0))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=16, n_layer=1,
                                                                  n_head=2))
    hf.save_pretrained(tmp_path / "hf")
    _tokenizer(tmp_path / "hf" / "tokenizer.json")
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0


@pytest.mark.parametrize("origin", ["imported", "trained"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_stops_generating_at_the_tokenizers_eos(tmp_path, kind, origin):
    if origin == "imported":
        _imported_checkpoint(tmp_path, kind)
    else:
        _trained_checkpoint(tmp_path, GPT2 if kind == "gpt2" else LLAMA)
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "hf"]) == 0
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    got = _generates_until_eos(tmp_path / "out")
    assert got["eos"] == 0 and got["bos"] == 0, got  # <|endoftext|> (and the imported Llama's own 0 / 0)
    assert got["new"] == [0] and got["warned"] == [], got


def test_export_without_a_tokenizer_sets_no_ids_outside_the_vocabulary(tmp_path):
    cfg = load_run_config(None, [f"model.{k}={v}" for k, v in GPT2.items()])
    model = GPT(cfg.model, seed=1)
    save_checkpoint(tmp_path / "ckpt", 1, model, build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95)),
                    {}, dump(cfg), model.rng)
    with contextlib.redirect_stdout(io.StringIO()):
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("bos_token_id") is None and config.get("eos_token_id") is None, config


def test_import_hint_does_not_repeat_a_given_data_source(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=16, n_layer=1,
                                                              n_head=2))
    hf.save_pretrained(tmp_path / "hf")
    shown = {}
    for name, extra in (("given", ["data.source=tokens.bin"]), ("none", [])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert seqpar(["import", str(tmp_path / "hf"), str(tmp_path / name), *extra]) == 0
        shown[name] = out.getvalue()
    assert "data.source=TOKENS" not in shown["given"] and "data.source=TOKENS" in shown["none"], shown

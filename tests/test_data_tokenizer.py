"""``data.tokenizer`` and the tokenizer a resumed checkpoint carries: text encoded with a
tokenizer the user brings (no BPE training), from ``seqpar import`` of a Hugging Face Llama through
``seqpar train`` on a text folder, ``seqpar generate`` and ``seqpar export --format hf``."""
import contextlib
import io
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402
from tokenizers.implementations import ByteLevelBPETokenizer  # noqa: E402

from seqpar.cli import main as seqpar  # noqa: E402
from seqpar.config import load_run_config  # noqa: E402
from seqpar.data import load_corpus, prepare_corpus  # noqa: E402
from seqpar.data.errors import DataError, TokenizerError  # noqa: E402
from seqpar.data.tokenizer import find_eot, load_tokenizer  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
V = 320  # model rows; the tokenizer below has fewer


def _texts(folder, n=12, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        words = rng.choice(WORDS, 120)
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + " ".join(words) + "\n")
    return folder


def _hf_tokenizer(folder, texts):
    """A small byte-level BPE saved the way Hugging Face model folders hold it."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([p.read_text() for p in sorted(texts.iterdir())], vocab_size=290, min_frequency=1,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _hf_llama(folder):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def test_import_train_on_text_with_the_checkpoints_tokenizer_generate_export(tmp_path):
    texts = _texts(tmp_path / "texts")
    tok = _hf_tokenizer(tmp_path / "hf", texts)
    _hf_llama(tmp_path / "hf")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert seqpar(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "train.micro_batch=2",
                       "model.recompute=none", "model.seq_len=16", f"out_dir={tmp_path / 'run'}"]) == 0
        config = tmp_path / "ckpt" / "step_00000000" / "config.yaml"
        assert seqpar(["train", str(config), f"data.source={texts}", f"data.cache_dir={tmp_path / 'cache'}",
                       "train.steps=2", "train.eval_interval=0", "train.log_interval=1",
                       "checkpoint.interval=0"]) == 0
    log = out.getvalue()
    assert "tokenizer of the resumed checkpoint" in log and "training byte-level BPE" not in log
    # the cache holds the text encoded with the checkpoint's tokenizer, documents joined by </s>
    cfg = load_run_config(config, [f"data.source={texts}", f"data.cache_dir={tmp_path / 'cache'}"])
    corpus = load_corpus(cfg, lambda _: None)
    eos = tok.token_to_id("</s>")
    expected = []
    for i, path in enumerate(sorted(texts.iterdir())):
        expected += ([eos] if i else []) + tok.encode(path.read_text()).ids
    assert np.asarray(corpus.tokens).tolist() == expected and corpus.eot_id == eos
    step2 = tmp_path / "ckpt" / "step_00000002"
    assert Tokenizer.from_file(str(step2 / "tokenizer.json")).to_str() == tok.to_str()
    assert json.loads((step2 / "tokenizer_origin.json").read_text()) == {"origin": "given", "eot_id": eos}
    sample = io.StringIO()
    with contextlib.redirect_stdout(sample):
        assert seqpar(["generate", str(tmp_path / "ckpt"), "--prompt", "alpha beta", "--tokens", "4"]) == 0
        assert seqpar(["export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--format", "hf"]) == 0
    assert sample.getvalue().startswith("alpha beta")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "back" / "tokenizer.json"))
    ids = torch.tensor([hf_tok("alpha beta gamma")["input_ids"]])
    assert ids.max() < V and torch.isfinite(back(input_ids=ids).logits).all()


def test_data_tokenizer_encodes_text_without_training_a_bpe(tmp_path):
    texts = _texts(tmp_path / "texts", n=3)
    tok = _hf_tokenizer(tmp_path / "hf", texts)
    logs = []
    cfg = load_run_config(None, [f"data.source={texts}", f"data.cache_dir={tmp_path / 'cache'}",
                                 f"data.tokenizer={tmp_path / 'hf'}", f"model.vocab_size={V}",
                                 f"checkpoint.dir={tmp_path / 'ck'}"])
    corpus = load_corpus(cfg, logs.append)
    assert corpus.tokenizer_given and corpus.eot_id == tok.token_to_id("</s>")
    assert not any("training byte-level BPE" in line for line in logs)
    first = (texts / "doc00.txt").read_text()
    assert np.asarray(corpus.tokens[:len(tok.encode(first).ids)]).tolist() == tok.encode(first).ids
    # the tokenizer.json file itself, and data.eot_id overriding the eos token
    cfg.data.tokenizer, cfg.data.eot_id = str(tmp_path / "hf" / "tokenizer.json"), tok.token_to_id("<s>")
    assert load_corpus(cfg, logs.append).eot_id == tok.token_to_id("<s>")
    # another tokenizer makes another cache entry, not a reuse of the first
    trained = prepare_corpus(texts, vocab_size=V, cache_dir=tmp_path / "cache", log=logs.append)
    assert not trained.tokenizer_given and trained.tokenizer.to_str() != tok.to_str()


def test_slow_tokenizer_folder_is_read_with_transformers(tmp_path):
    """A folder with vocab.json + merges.txt (no tokenizer.json) is converted by transformers."""
    texts = _texts(tmp_path / "texts", n=2)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([p.read_text() for p in texts.iterdir()], vocab_size=280, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    (tmp_path / "slow").mkdir()
    bpe.save_model(str(tmp_path / "slow"))
    (tmp_path / "slow" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                                         "eos_token": "<|endoftext|>"}))
    loaded = load_tokenizer(tmp_path / "slow")
    assert loaded.encode("alpha beta gamma").ids == bpe.encode("alpha beta gamma").ids
    assert find_eot(loaded, tmp_path / "slow") == bpe.token_to_id("<|endoftext|>")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="empty.*no tokenizer could be read"):
        load_tokenizer(tmp_path / "empty")


def test_tokenizer_errors_name_the_file_and_the_sizes(tmp_path):
    texts = _texts(tmp_path / "texts", n=2)
    _hf_tokenizer(tmp_path / "hf", texts)
    base = [f"data.source={texts}", f"data.cache_dir={tmp_path / 'cache'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    small = load_run_config(None, base + [f"data.tokenizer={tmp_path / 'hf'}", "model.vocab_size=260"])
    with pytest.raises(TokenizerError, match=r"has 29\d tokens, more than model.vocab_size=260"):
        load_corpus(small, print)
    missing = load_run_config(None, base + [f"data.tokenizer={tmp_path / 'nope'}", f"model.vocab_size={V}"])
    with pytest.raises(TokenizerError, match="nope.*does not exist"):
        load_corpus(missing, print)
    (tmp_path / "bad.json").write_text("{not json")
    broken = load_run_config(None, base + [f"data.tokenizer={tmp_path / 'bad.json'}", f"model.vocab_size={V}"])
    with pytest.raises(TokenizerError, match="bad.json.*unreadable"):
        load_corpus(broken, print)
    far = load_run_config(None, base + [f"data.tokenizer={tmp_path / 'hf'}", f"model.vocab_size={V}",
                                        f"data.eot_id={V}"])
    with pytest.raises(DataError, match=f"data.eot_id={V} is outside"):
        load_corpus(far, print)
    bare = Tokenizer.from_str(Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).to_str())
    bare.save(str(tmp_path / "noeos.json"))
    data = json.loads((tmp_path / "noeos.json").read_text())
    data["added_tokens"] = []
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if k not in ("<s>", "</s>")}
    (tmp_path / "noeos.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="set data.eot_id"):
        find_eot(Tokenizer.from_file(str(tmp_path / "noeos.json")), tmp_path / "noeos.json")

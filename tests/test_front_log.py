"""The run's first lines say what runs and where its outputs go, without the 75-line config dump
(written to out_dir, printed by --show-config); parameter counts per rank are true under FSDP."""
import contextlib
import io
import re
from pathlib import Path

from run_helpers import TINY_MODEL, run_overrides
from seqpar.cli import main as seqpar
from seqpar.config import load_run_config

RUN = {**TINY_MODEL, "model.layers": 1, "model.heads": 2, "train.micro_batch": 2, "train.log_interval": 1,
       "train.eval_interval": 0, "checkpoint.interval": 0, "train.precision": "fp32", "train.memory_check": False,
       "train.steps": 1}


def test_header_names_the_outputs_and_the_config_goes_to_a_file(tmp_path, capsys):
    overrides = run_overrides(tmp_path, RUN)
    assert seqpar(["train", *overrides]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "resolved config:" not in out and len(lines) < 15, out
    where = next(ln for ln in lines if ln.startswith("outputs:"))
    assert str(tmp_path / "ckpt") in where and str(tmp_path / "out" / "metrics.jsonl") in where, where
    assert "TensorBoard" in where and str(tmp_path / "out" / "config.yaml") in where, where
    assert load_run_config(tmp_path / "out" / "config.yaml").train.steps == 1
    assert seqpar(["train", "--show-config", *overrides, f"out_dir={tmp_path / 'again'}",
                   f"checkpoint.dir={tmp_path / 'ckpt2'}"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("config:\n") and "  train:\n" in shown and "    steps: 1\n" in shown, shown[:400]


def _fsdp_parameters(rank, world, tmp):
    from seqpar import init_parallel
    from seqpar.train import train

    out = io.StringIO()
    overrides = run_overrides(Path(tmp), RUN) + ["parallel.dp=2", "parallel.data_parallel=fsdp"]
    with contextlib.redirect_stdout(out):
        train(load_run_config(None, overrides), mesh=init_parallel(tp=1, dp=2))
    return out.getvalue()


def test_parameters_on_this_rank_are_the_fsdp_shard(spawn, tmp_path):
    out = spawn(_fsdp_parameters, 2, str(tmp_path))[0]
    full, here = (int(x.replace(",", "")) for x in re.search(r"parameters: ([\d,]+) in the full model, ([\d,]+) on "
                                                              r"this rank", out).groups())
    assert full / 2 <= here < full * 0.6, out


def test_a_corpus_another_rank_encoded_still_gets_its_data_line(tmp_path):
    from seqpar.data.corpus import prepare_corpus

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 300)
    first, second = [], []
    for lines in (first, second):  # the second caller finds the cache the first one built
        prepare_corpus(tmp_path / "texts", vocab_size=300, cache_dir=tmp_path / "cache", log=lines.append)
    assert any(ln.startswith("data: encoded 1 documents") for ln in first), first
    assert any(re.match(r"data: 1 documents, [\d,]+ tokens \(cache ", ln) for ln in second), second


def test_the_end_of_run_sample_starts_from_the_data_or_the_given_prompt(tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    import seqpar.train.trainer as trainer

    words = ["<|endoftext|>", "<unk>", "the", "cat", "sat", "on", "mat", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "texts").mkdir()
    for i in range(4):
        (tmp_path / "texts" / f"{i}.txt").write_text("the cat sat on the mat . " * 60)
    base = [o for o in run_overrides(tmp_path, {**RUN, "model.vocab_size": 300}) if not o.startswith("data.source")]
    base += [f"data.source={tmp_path / 'texts'}", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
             f"data.cache_dir={tmp_path / 'cache'}", "data.eval_fraction=0.3"]
    asked, sample_ids = [], trainer.sample_ids
    monkeypatch.setattr(trainer, "sample_ids", lambda m, p, n, **kw: asked.append(n) or sample_ids(m, p, n, **kw))
    samples = {}
    for name, extra in (("data", []), ("given", ["train.sample_prompt=cat on"]),
                        ("three", ["train.sample_prompt=cat on", "train.sample_tokens=3"]),
                        ("off", ["train.sample_tokens=0"])):
        assert seqpar(["train", *base, *extra, f"checkpoint.dir={tmp_path / name}"]) == 0
        samples[name] = capsys.readouterr().out.split("sample:", 1)[1:]
    assert samples["data"][0].startswith("\nthe cat sat"), samples
    assert samples["given"][0].startswith("\ncat on"), samples
    assert asked == [48, 48, 3], asked  # train.sample_tokens: 48 by default
    assert samples["off"] == [], samples  # train.sample_tokens=0: no sample
    assert seqpar(["train", *base, "train.sample_tokens=-1"]) == 2
    assert "train.sample_tokens" in capsys.readouterr().err

"""Strict nested-dataclass config loading: types, unknown keys, precedence, round trip."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from seqpar.config import (ConfigError, dump, dump_yaml, from_dict, load, load_run_config, load_sections, merge,
                           parse_overrides, resolve_config, shipped_configs, shipped_dir, to_dict)
from seqpar.errors import UserError


@dataclass
class Model:
    layers: int = 2
    hidden: int = 64
    activation: Literal["gelu", "relu"] = "gelu"
    dropout: float = 0.1
    bias: bool = True

    def validate(self) -> None:
        if self.hidden % 2:
            raise UserError(f"model.hidden must be even, got {self.hidden}")
        if self.layers == 13:  # a bug inside validate(), not bad input
            raise ValueError("internal")


@dataclass
class Train:
    lr: float = 1e-3
    steps: int = 10
    schedule: tuple[int, ...] = (1, 2)
    tags: list[str] = field(default_factory=list)
    warmup: Optional[int] = None
    path: str | None = "data.txt"


@dataclass
class Config:
    name: str
    model: Model = field(default_factory=Model)
    train: Train = field(default_factory=Train)


@dataclass
class Pair:
    shape: tuple[int, int] = (1, 1)
    sizes: dict[str, int] = field(default_factory=dict)


def test_defaults_and_nested_values():
    cfg = from_dict(Config, {"name": "x", "model": {"layers": 4}, "train": {"schedule": [3, 4, 5]}})
    assert cfg == Config(name="x", model=Model(layers=4), train=Train(schedule=(3, 4, 5)))
    assert isinstance(cfg.train.schedule, tuple)


def test_missing_required_field():
    with pytest.raises(ConfigError, match=r"missing required key 'name'"):
        from_dict(Config, {})


def test_unknown_key_names_dotted_key_and_valid_keys():
    with pytest.raises(ConfigError, match=r"'model\.layer'.*valid keys: \['activation', 'bias', 'dropout', "
                                          r"'hidden', 'layers'\]"):
        from_dict(Config, {"name": "x", "model": {"layer": 4}})


@pytest.mark.parametrize("data, pattern", [
    ({"model": {"layers": 2.5}}, r"model\.layers: expected int, got 2\.5 \(float\)"),
    ({"model": {"layers": True}}, r"model\.layers: expected int, got True"),
    ({"model": {"bias": 1}}, r"model\.bias: expected bool, got 1 \(int\)"),
    ({"model": {"bias": "yes"}}, r"model\.bias: expected bool, got 'yes'"),
    ({"model": {"dropout": "0.1"}}, r"model\.dropout: expected float, got '0\.1'"),
    ({"model": {"activation": "tanh"}}, r"model\.activation: expected one of \['gelu', 'relu'\], got 'tanh'"),
    ({"train": {"schedule": [1, "a"]}}, r"train\.schedule\[1\]: expected int, got 'a'"),
    ({"train": {"schedule": 3}}, r"train\.schedule: expected tuple\[int, \.\.\.\], got 3"),
    ({"train": {"tags": ["a", 2]}}, r"train\.tags\[1\]: expected str, got 2"),
    ({"train": {"warmup": "x"}}, r"train\.warmup: expected int, got 'x'"),
    ({"model": 3}, r"model: expected a mapping for Model, got 3"),
    ({"name": 5}, r"name: expected str, got 5"),
])
def test_wrong_types_name_key_type_and_value(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(Config, {"name": "x", **data})


def test_accepted_coercions_and_optionals():
    cfg = from_dict(Config, {"name": "x", "model": {"dropout": 0}, "train": {"warmup": None, "path": None}})
    assert cfg.model.dropout == 0.0 and isinstance(cfg.model.dropout, float)
    assert cfg.train.warmup is None and cfg.train.path is None
    assert from_dict(Train, {"warmup": 5}).warmup == 5


def test_fixed_tuple_and_dict():
    assert from_dict(Pair, {"shape": [2, 3], "sizes": {"a": 1}}) == Pair((2, 3), {"a": 1})
    with pytest.raises(ConfigError, match=r"shape: expected 2 items"):
        from_dict(Pair, {"shape": [1, 2, 3]})
    with pytest.raises(ConfigError, match=r"sizes\.a: expected int"):
        from_dict(Pair, {"sizes": {"a": "b"}})


def test_validate_runs_after_construction():
    with pytest.raises(ConfigError, match="model.hidden must be even, got 63"):
        from_dict(Config, {"name": "x", "model": {"hidden": 63}})
    # only bad input (a UserError) becomes a ConfigError; any other error of validate() is a bug
    with pytest.raises(ValueError, match="internal") as info:
        from_dict(Config, {"name": "x", "model": {"layers": 13}})
    assert not isinstance(info.value, UserError)


def test_where_prefix_in_errors():
    with pytest.raises(ConfigError, match=r"unknown key 'outer\.model\.x'"):
        from_dict(Model, {"x": 1}, where="outer.model")


def test_parse_overrides():
    out = parse_overrides(["train.lr=3e-4", "model.layers=4", "train.path=null", "train.tags=[a, b]",
                           "model.bias=false", "name=run 1", "train.steps=1E3", "train.lr=-2.5e-5"])
    assert out == {"train": {"lr": -2.5e-5, "path": None, "tags": ["a", "b"], "steps": 1000.0},
                   "model": {"layers": 4, "bias": False}, "name": "run 1"}
    assert isinstance(parse_overrides(["a=3e-4"])["a"], float)
    assert parse_overrides(["a=1.5e+2"])["a"] == 150.0
    assert parse_overrides(["a=x=y"])["a"] == "x=y"


@pytest.mark.parametrize("items, pattern", [
    (["train.lr"], r"override 'train\.lr' is not of the form key=value"),
    (["train..lr=1"], r"empty key segment"),
    (["a=1", "a.b=2"], r"override 'a\.b=2' conflicts with earlier value a=1"),
    (["a=[1,"], r"override 'a=\[1,': value"),
])
def test_bad_overrides(items, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_overrides(items)


def test_merge_is_deep_and_pure():
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    over = {"a": {"c": 5}, "e": 6}
    assert merge(base, over) == {"a": {"b": 1, "c": 5}, "d": 3, "e": 6}
    assert base == {"a": {"b": 1, "c": 2}, "d": 3} and over == {"a": {"c": 5}, "e": 6}
    assert merge({"a": {"b": 1}}, {"a": None}) == {"a": None}


def test_load_precedence_cli_over_file_over_defaults(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("name: file\nmodel:\n  layers: 6\n  hidden: 32\ntrain:\n  lr: 3e-4\n")
    cfg = load(Config, path, ["model.layers=8"])
    assert cfg.name == "file" and cfg.model.layers == 8 and cfg.model.hidden == 32
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 10
    assert load(Config, None, ["name=cli"]) == Config(name="cli")


def test_load_file_errors(tmp_path):
    # a file that sets nothing would run the defaults unnoticed: refused, even with overrides
    for text in ("", "# only a comment\n", "{}\n", "model:\ntrain: {}\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml' sets no key .* set at least one of \['model', 'name', "
                                              r"'train'\], or leave the file out"):
            load(Config, empty, ["name=x"])
    empty.write_text("name: x\nmodel:\n")
    assert load(Config, empty) == Config(name="x")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml' must hold a mapping at top level, got list"):
        load(Config, listy)
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load(Config, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr'"):
        load(Config, None, ["name=x", "train.lrr=1"])


def test_to_dict_and_yaml_round_trip(tmp_path):
    cfg = Config(name="rt", model=Model(activation="relu", dropout=0.0),
                 train=Train(lr=3e-4, schedule=(5, 6), tags=["a"], warmup=7, path=None))
    plain = to_dict(cfg)
    assert plain["train"]["schedule"] == [5, 6] and plain["model"]["activation"] == "relu"
    path = tmp_path / "dump.yaml"
    path.write_text(dump_yaml(cfg))
    assert load(Config, path) == cfg
    assert dump_yaml(cfg).splitlines()[0] == "name: rt"


def test_load_sections_checks_named_sections_and_ignores_others(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  layers: 4\ntrain:\n  lr: 3e-4\noptim:\n  anything: 1\n")
    out = load_sections(path, {"model": Model, "train": Train}, required={"model": ["layers"]})
    assert out == {"model": Model(layers=4), "train": Train(lr=3e-4)}
    path.write_text("model:\n  layer: 4\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: unknown key 'model\.layer'"):
        load_sections(path, {"model": Model})
    path.write_text("model:\n  hidden: 33\n")  # Model.validate() runs; the message names the file
    with pytest.raises(ConfigError, match=r"run\.yaml: model\.hidden must be even, got 33"):
        load_sections(path, {"model": Model})
    with pytest.raises(ConfigError, match=r"missing config key 'model\.layers'"):
        load_sections(path, {"model": Model}, required={"model": ["layers"]})
    with pytest.raises(ConfigError, match=r"missing config key 'train'"):
        load_sections(path, {"model": Model}, required={"train": ["lr"]})


def test_shipped_configs_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    names = shipped_configs()
    assert {"tiny-cpu", "memory-demo", "paper/22b", "paper/175b", "paper/530b", "paper/1t"} <= set(names)
    monkeypatch.chdir(tmp_path)  # no configs/ here: only the packaged files can answer
    tiny = resolve_config("tiny-cpu")
    assert tiny == shipped_dir() / "tiny-cpu.yaml" and tiny.is_file()
    for alias in ("tiny-cpu.yaml", "configs/tiny-cpu.yaml", "./configs/tiny-cpu.yml"):
        assert resolve_config(alias) == tiny
    assert resolve_config("paper/175b") == shipped_dir() / "paper" / "175b.yaml"
    assert load_run_config("tiny-cpu", ["train.steps=3"]) == load_run_config(tiny, ["train.steps=3"])
    assert load_run_config("tiny-cpu").parallel.tp == 2


def test_existing_files_win_and_unknown_names_list_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-cpu").write_text("train:\n  steps: 7\n")  # a local file shadows the shipped name
    assert load_run_config("tiny-cpu").train.steps == 7
    with pytest.raises(FileNotFoundError, match=r"'tiny-gpu' is neither .* shipped configs: .*paper/175b.*tiny-cpu"):
        load_run_config("tiny-gpu")
    missing = tmp_path / "sub" / "tiny-cpu.yaml"  # an absolute path never falls back to a shipped name
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_run_config(missing)


def test_every_shipped_run_config_loads_strictly():
    for name in shipped_configs():
        if not name.startswith("paper/"):  # paper/ models use pp > 1: memory planning only
            load_run_config(name)


# --------------------------------------------------------------------------- values checked where they enter

@pytest.mark.parametrize("override, key, shown", [
    ("train.global_batch=0", "train.global_batch", "0"),
    ("train.global_batch=-8", "train.global_batch", "-8"),
    ("train.lr=.nan", "train.lr", "nan"),
    ("train.lr=.inf", "train.lr", "inf"),
    ("train.min_lr=.nan", "train.min_lr", "nan"),
    ("train.min_lr=-.inf", "train.min_lr", "-inf"),
    ("train.beta1=1.0", "train.beta1", "1.0"),
    ("train.beta1=-0.1", "train.beta1", "-0.1"),
    ("train.beta2=1.5", "train.beta2", "1.5"),
    ("train.beta2=.nan", "train.beta2", "nan"),
    ("train.weight_decay=-0.01", "train.weight_decay", "-0.01"),
    ("train.weight_decay=.nan", "train.weight_decay", "nan"),
    ("train.grad_clip=-1", "train.grad_clip", "-1.0"),
    ("train.threads_per_rank=0", "train.threads_per_rank", "0"),
    ("train.warmup_steps=-1", "train.warmup_steps", "-1"),
    ("train.eval_interval=-5", "train.eval_interval", "-5"),
    ("train.eval_batches=0", "train.eval_batches", "0"),
    ("train.nonfinite_grads=ignore", "train.nonfinite_grads", "'ignore'"),
    ("parallel.timeout_minutes=0", "parallel.timeout_minutes", "0.0"),
    ("parallel.timeout_minutes=-3", "parallel.timeout_minutes", "-3.0"),
    ("parallel.timeout_minutes=.inf", "parallel.timeout_minutes", "inf"),
    ("parallel.tp=0", "parallel.tp", "0"),
    ("parallel.dp=-2", "parallel.dp", "-2"),
    ("model.layernorm_eps=0", "model.layernorm_eps", "0.0"),
    ("model.layernorm_eps=-1e-5", "model.layernorm_eps", "-1e-05"),
    ("model.init_std=.nan", "model.init_std", "nan"),
    ("model.init_std=.inf", "model.init_std", "inf"),
    ("model.dropout=1.0", "model.dropout", "1.0"),
    ("data.eval_fraction=0", "data.eval_fraction", "0.0"),
    ("data.eval_fraction=1", "data.eval_fraction", "1.0"),
    ("data.eval_fraction=.nan", "data.eval_fraction", "nan"),
    ("data.max_bytes=0", "data.max_bytes", "0"),
    ("checkpoint.keep=0", "checkpoint.keep", "0"),
    ("checkpoint.interval=-1", "checkpoint.interval", "-1"),
])
def test_bad_values_are_refused_at_load_naming_the_dotted_key_and_value(override, key, shown, tmp_path):
    with pytest.raises(ConfigError) as err:  # a ConfigError, at load time: before any data or process work
        load_run_config(None, [override])
    assert key in str(err.value) and shown in str(err.value), str(err.value)
    section, name = key.split(".")
    path = tmp_path / "run.yaml"  # the same value from a file
    path.write_text(f"{section}:\n  {name}: {override.split('=', 1)[1]}\n")
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_run_config(path)


def test_nonfinite_grads_is_a_train_key():
    assert load_run_config(None).train.nonfinite_grads == "stop"
    assert load_run_config(None, ["train.nonfinite_grads=skip"]).train.nonfinite_grads == "skip"


def test_good_edge_values_still_load():
    cfg = load_run_config(None, ["train.beta1=0", "train.beta2=0.999", "train.weight_decay=0", "train.min_lr=0",
                                 "train.grad_clip=0", "train.global_batch=null", "model.init_std=0",
                                 "data.eval_fraction=0.5", "parallel.timeout_minutes=0.5", "train.warmup_steps=0"])
    assert cfg.train.beta1 == 0.0 and cfg.train.global_batch is None and cfg.data.eval_fraction == 0.5


def test_python_built_configs_are_checked_by_validate():
    from seqpar.config import RunConfig, TrainConfig
    with pytest.raises(ValueError, match=r"train\.lr must be a finite number"):
        RunConfig(train=TrainConfig(lr=float("nan"))).validate()  # what the Trainer calls on every rank


def _alias_bomb(levels: int, width: int) -> str:
    """``[[x]*w, [that]*w, ...]``: a few hundred bytes of YAML whose value prints as width**levels items."""
    items = [f"&l0 [{', '.join(['x'] * width)}]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("key", ["train.lr", "train.global_batch", "model.activation", "checkpoint.dir"])
def test_error_messages_cap_the_printed_value(key, tmp_path):
    section, name = key.split(".")
    path = tmp_path / "bomb.yaml"
    path.write_text(f"{section}:\n  {name}: {_alias_bomb(6, 10)}\n")  # prints as 10**6 items, ~5 MB
    assert path.stat().st_size < 1000
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert key in str(err.value) and len(str(err.value)) < 500, len(str(err.value))


def test_long_values_and_keys_are_capped_in_messages(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["train.lr=" + "x" * 100_000])
    assert "train.lr" in str(err.value) and len(str(err.value)) < 1000
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  {'k' * 1000}: 1\n")  # YAML caps plain keys at 1024
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert "unknown key 'train.kkk" in str(err.value) and len(str(err.value)) < 1000


def test_empty_override_value_is_an_error_not_the_default():
    for item in ("train.global_batch=", "data.source=", "train.lr=  "):
        with pytest.raises(ConfigError, match=re.escape(f"override {item!r}") + r".*empty"):
            parse_overrides([item])
    assert parse_overrides(["train.global_batch=null"]) == {"train": {"global_batch": None}}


@pytest.mark.parametrize("raw, value", [
    ("010", 10), ("-007", -7), ("0o17", 15), ("0x1f", 31), ("1_000", "1_000"), ("1:30", "1:30"),
    ("0b101", "0b101"), ("yes", "yes"), ("no", "no"), ("on", "on"), ("off", "off"), ("y", "y"),
    ("true", True), ("false", False), ("True", True), ("FALSE", False), ("null", None), ("~", None),
    ("3e-4", 3e-4), ("1E3", 1000.0), ("-.5", -0.5), ("1.", 1.0), ("2024-01-01", "2024-01-01"), ("=", "="),
    ("run #1", "run #1"), ("a#b", "a#b"), ("#x", "#x"), ("a: b", "a: b"), ("- a", "- a"), ("*ref", "*ref"),
    ("!!python/name:os.system", "!!python/name:os.system"), ("'010'", "010"), ('"a # b"', "a # b"),
    ("[1, 010]", [1, 10]), ("{a: 0o10}", {"a": 8}),
])
def test_override_values_are_yaml_1_2_scalars(raw, value):
    got = parse_overrides([f"k={raw}"])["k"]
    assert got == value and type(got) is type(value), (raw, got)


def test_override_comment_after_a_quoted_or_flow_value_is_refused():
    for item in ("k='a' # b", "k=[1, 2] # two"):
        with pytest.raises(ConfigError, match=re.escape(repr(item))):
            parse_overrides([item])


def test_files_are_read_as_yaml_1_2_and_dumped_so_they_read_back(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 010\n  seed: 0x10\n  micro_batch: 1_0\n")
    with pytest.raises(ConfigError, match=r"train\.micro_batch: expected int, got '1_0'"):
        load_run_config(path)
    path.write_text("train:\n  steps: 010\n  seed: 0x10\nmodel:\n  bias: false\nout_dir: 1:30\n"
                    "checkpoint:\n  dir: 2024-01-01\n")
    cfg = load_run_config(path)
    assert (cfg.train.steps, cfg.train.seed, cfg.out_dir, cfg.checkpoint.dir) == (10, 16, "1:30", "2024-01-01")
    path.write_text("model:\n  bias: no\n")
    with pytest.raises(ConfigError, match=r"model\.bias: expected bool, got 'no'"):
        load_run_config(path)
    odd = load_run_config(None, ["out_dir='0o17'", "data.source='09'", "checkpoint.dir=yes", "data.cache_dir='1e5'"])
    path.write_text(dump(odd))  # strings that 1.2 would read as numbers are quoted when dumped
    assert load_run_config(path) == odd


def test_strings_with_unicode_line_breaks_round_trip_through_yaml():
    """NEL, LS and PS are line breaks to YAML: quoted plainly they folded to a space on reading."""
    from seqpar.config import yaml12
    for text in ("\x85", "cache\u2028dir", "a\u2029", "plain"):
        assert yaml12.load(yaml12.dump({"k": text}))["k"] == text

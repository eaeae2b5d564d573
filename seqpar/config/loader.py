"""Strict loading of nested config dataclasses from a YAML file plus ``key=value`` overrides.

Precedence: command-line overrides > file > dataclass defaults. Every key is checked: an unknown
key, a value of the wrong type or a missing required field raises :class:`ConfigError` naming the
full dotted key (``train.lr``) and the offending value, printed at most ~120 characters long (a
YAML alias bomb must not build a megabyte message). After a dataclass is built, its ``validate()``
method runs if it has one, so range and cross-field checks live next to the fields; a
:class:`~seqpar.errors.UserError` it raises becomes a :class:`ConfigError` (any other exception
is a bug and propagates as it is), and a message that starts with the class
name (``GPTConfig.init_std ...``) names the dotted key instead (``model.init_std ...``).

Files and ``key=value`` overrides are read with the YAML 1.2 core schema (:mod:`.yaml12`):
``010`` is ten, ``1:30`` and ``yes`` are strings, only ``true``/``false`` are booleans.

Supported annotations: ``int``, ``float`` (ints accepted), ``bool`` (only ``true``/``false``),
``str``, ``Literal[...]``, ``X | None``, unions, ``tuple[X, ...]``, ``tuple[X, Y]``,
``list[X]``, ``dict[str, X]`` and nested dataclasses.
"""
from __future__ import annotations

import copy
import dataclasses
import reprlib
import types
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ..errors import MissingFile, UserError, file_error
from . import yaml12

T = TypeVar("T")


class ConfigError(UserError):
    """A config file or override that does not match the dataclass schema."""


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 3, 80, 80
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 4
SHOW_LIMIT = 120


def show(value: Any) -> str:
    """``repr(value)`` cut to about :data:`SHOW_LIMIT` characters without building the full repr
    (nested containers stop at depth 3 and 4 items: ``[[[[...], ...], ...], ...]``)."""
    text = _SHOW.repr(value)
    return text if len(text) <= SHOW_LIMIT else text[:SHOW_LIMIT - 3] + "..."


def yaml_load(text: str) -> Any:
    """Parse YAML ``text`` with the YAML 1.2 core schema (``3e-4`` a float, ``010`` ten, ``yes`` a string)."""
    return yaml12.load(text)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return repr(tp).replace("typing.", "")


def _fail(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{key or '<root>'}: expected {_type_name(tp)}, got {show(value)} ({type(value).__name__})")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it in the annotated form."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return value if isinstance(value, tp) else from_dict(tp, value, where=key)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, key)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in get_args(tp)):
            return value
        raise ConfigError(f"{key}: expected one of {list(get_args(tp))}, got {show(value)}")
    if tp in (bool, int, float, str):
        return _convert_scalar(tp, value, key)
    if origin in (tuple, list):
        return _convert_sequence(tp, value, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(key, tp, value)
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(key_tp, k, f"{key}.<key>"): _convert(val_tp, v, _join(key, str(k))) for k, v in value.items()}
    raise TypeError(f"{key}: unsupported annotation {_type_name(tp)} in config schema")  # a bug in a schema


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    """``X | Y | None``: ``None`` only if allowed, else the first member that accepts ``value``."""
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise _fail(key, tp, value)
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, key)
        except ConfigError as err:
            errors.append(str(err))
    if len(errors) == 1:  # ``X | None``: X's own message is the precise one
        raise ConfigError(errors[0])
    raise _fail(key, tp, value)


def _convert_scalar(tp: type, value: Any, key: str) -> Any:
    """``bool`` / ``int`` / ``float`` / ``str``: no coercion except int -> float; bools are not ints."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: is_number and isinstance(value, int),
          float: is_number, str: isinstance(value, str)}[tp]
    if not ok:
        raise _fail(key, tp, value)
    return float(value) if tp is float else value


def _convert_sequence(tp: Any, value: Any, key: str) -> tuple | list:
    """``list[X]``, ``tuple[X, ...]`` (any length) and ``tuple[X, Y]`` (exactly these items)."""
    origin, args = get_origin(tp), get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise _fail(key, tp, value)
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} items for {_type_name(tp)}, got {show(list(value))}")
        items = [_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    else:
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


# keys that existed once -> what replaces them (a clear error instead of "unknown key")
RENAMED = {
    "train.autocast": "train.autocast was replaced by train.precision: bf16-autocast (the old autocast: bf16), "
                      "bf16 (bf16 compute on fp32 master weights, as in the paper), fp32, or auto (bf16 on CUDA, "
                      "fp32 on CPU)",
}


def config_key(f: dataclasses.Field) -> str:
    """The YAML key of dataclass field ``f``: its name, or ``metadata["key"]`` for a key that is a
    Python keyword (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("key", f.name)


def from_dict(cls: type[T], data: dict, *, where: str = "") -> T:
    """Build dataclass ``cls`` from a plain nested dict, checking every key and type.

    ``where`` is the dotted prefix used in error messages (``"model"`` gives ``model.layers``).
    Missing keys take the dataclass defaults; ``cls.validate()`` runs after construction.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict: {cls!r} is not a dataclass type")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or '<root>'}: expected a mapping for {cls.__name__}, "
                          f"got {show(data)} ({type(data).__name__})")
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    for k in unknown:
        if _join(where, str(k)) in RENAMED:
            raise ConfigError(RENAMED[_join(where, str(k))])
    if unknown:
        raise ConfigError(f"unknown key {show(_join(where, str(unknown[0])))} for {cls.__name__}; "
                          f"valid keys: {sorted(fields)}")
    hints = get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        key = _join(where, name)
        if name in data:
            kwargs[field.name] = _convert(hints[field.name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key {key!r} ({_type_name(hints[field.name])}) for {cls.__name__}")
    obj = cls(**kwargs)
    _validate(obj, where)
    return obj


def _validate(obj: Any, where: str) -> None:
    """Run ``obj.validate()``; its ``UserError`` becomes a ConfigError under the dotted key."""
    validate = getattr(obj, "validate", None)
    if not callable(validate):
        return
    try:
        validate()
    except ConfigError:
        raise
    except UserError as err:
        msg, prefix = str(err), type(obj).__name__ + "."
        if where and msg.startswith(prefix):  # "GPTConfig.init_std must ..." -> "model.init_std must ..."
            msg = f"{where}.{msg[len(prefix):]}"
        raise ConfigError(msg) from None


def override_value(item: str, raw: str) -> Any:
    """The value of override ``item`` (whose text after the first ``=`` is ``raw``).

    Quoted strings and flow collections (``'010'``, ``[1, 2]``, ``{a: 1}``) are parsed as YAML, and a
    ``# comment`` after them is refused; anything else is one plain YAML 1.2 scalar, read whole, so a
    ``#`` or ``: `` inside it is kept (``name=run #1``). An empty value is an error: write ``null``.
    """
    text = raw.strip()
    if not text:
        raise ConfigError(f"override {show(item)}: empty value (write null for None, '' for an empty string)")
    if text[0] not in "'\"[{":
        return yaml12.plain_scalar(text)
    try:
        value = yaml12.load(text)
        rest = yaml12.trailing_text(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {show(item)}: value {show(raw)} is not valid YAML ({err})") from None
    if rest:
        raise ConfigError(f"override {show(item)}: {show(rest)} after the value would be dropped as a YAML "
                          f"comment; quote the whole value to keep it")
    return value


def parse_overrides(items: Iterable[str]) -> dict:
    """``["train.lr=3e-4", "model.layers=4"]`` -> ``{"train": {"lr": 0.0003}, "model": {"layers": 4}}``.

    Values are YAML 1.2 (``null``, ``true``, ``[1, 2]``, ``3e-4``, ``010`` = 10; see
    :func:`override_value`); a later item for the same key wins.
    """
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {show(item)} is not of the form key=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {show(item)} has an empty key segment in {show(key)}")
        value = override_value(item, raw)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {show(item)} conflicts with earlier value "
                                  f"{'.'.join(parts[:i + 1])}={show(child)}")
            node = child
        if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
            raise ConfigError(f"override {show(item)} conflicts with earlier overrides under {show(key.strip())}")
        node[parts[-1]] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """Deep merge: nested dicts merge key by key, any other value in ``over`` replaces. Inputs untouched."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of YAML file ``path``; an empty file gives ``{}``."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text()
    except OSError as err:
        raise file_error(f"config file {str(path)!r}", err) from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level, got {type(data).__name__}")
    return data


def _check_not_empty(cls: type, path: str | Path, data: dict) -> None:
    """Refuse a file that sets nothing (empty, only comments, ``{}``, sections without keys): it
    would run the defaults unnoticed, most likely not what the file was meant to say."""
    if any(value not in (None, {}) for value in data.values()):
        return
    keys = sorted(config_key(f) for f in dataclasses.fields(cls) if f.init)
    raise ConfigError(f"config file {str(path)!r} sets no key (it is empty or its sections are), so it would "
                      f"run the built-in defaults; set at least one of {keys}, or leave the file out to use "
                      f"the defaults")


def load(cls: type[T], path: str | Path | None, overrides: Iterable[str] = ()) -> T:
    """Build ``cls`` from defaults, then file ``path`` (if given; a file that sets no key is
    refused), then ``key=value`` overrides."""
    data = read_yaml(path) if path is not None else {}
    if path is not None:
        _check_not_empty(cls, path, data)
    return from_dict(cls, merge(data, parse_overrides(overrides)))


def load_sections(path: str | Path, sections: Mapping[str, type],
                  required: Mapping[str, Iterable[str]] | None = None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Build each named top-level section of YAML file ``path`` (with ``key=value`` ``overrides`` on
    top) as its dataclass; others are ignored.

    ``load_sections(p, {"model": GPTConfig})`` checks every key of ``model:`` as :func:`from_dict`
    does; ``required={"model": ["hidden"]}`` also refuses a file that leaves ``model.hidden`` to
    the default (an override sets it too). Errors name the path and the dotted key.
    """
    data = merge(read_yaml(path), parse_overrides(overrides))
    for section, keys in (required or {}).items():
        if section not in data:
            raise ConfigError(f"{path}: missing config key {section!r} (a mapping with {list(keys)})")
        if isinstance(data[section], dict):
            missing = [k for k in keys if k not in data[section]]
            if missing:
                raise ConfigError(f"{path}: missing config key {_join(section, missing[0])!r}")
    out = {}
    for section, cls in sections.items():
        try:
            out[section] = from_dict(cls, data.get(section), where=section)
        except UserError as err:  # ConfigError, or a validate() check
            raise ConfigError(f"{path}: {err}") from None
    return out


def to_dict(obj: Any) -> Any:
    """Plain YAML-serialisable form of a config: dataclasses -> dicts (init fields), tuples -> lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def dump_yaml(obj: Any) -> str:
    """YAML 1.2 text of ``to_dict(obj)`` in field order; ``load`` of it rebuilds an equal config."""
    return yaml12.dump(to_dict(obj))

"""YAML for configs, read and written with the YAML 1.2 core schema.

PyYAML implements YAML 1.1, where ``010`` is 8, ``1:30`` is 90, ``yes``/``on``/``no`` are booleans
and ``2024-01-01`` is a date. Here only these plain scalars are not strings (YAML 1.2 core):

* null: ``null``, ``Null``, ``NULL``, ``~`` and the empty value
* bool: ``true``/``false`` (also ``True``, ``TRUE``, ``False``, ``FALSE``)
* int: decimal ``[-+]?[0-9]+`` (``010`` is ten), ``0o17``, ``0x1f``
* float: ``1.5``, ``.5``, ``3e-4``, ``1.0e+16``, ``.inf``, ``-.inf``, ``.nan``

The dumper uses the same rules, so a string that would read back as something else is quoted.
Only PyYAML's safe constructors are used: nothing read here can run code.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

_NULL, _BOOL = "tag:yaml.org,2002:null", "tag:yaml.org,2002:bool"
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_CORE_RESOLVERS = [  # (tag, pattern, possible first characters); the first match wins
    (_BOOL, r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    (_INT, r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    (_FLOAT, r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
             r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+0123456789.")),
    (_NULL, r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:merge", r"^<<$", ["<"]),  # `<<: *base` merge keys in files
]


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (YAML would keep the last silently)."""


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the YAML 1.2 core schema's implicit types; a key given twice in one
    mapping is an error (:class:`DuplicateKey`), keys brought in by a ``<<`` merge may be overridden."""

    yaml_implicit_resolvers: dict = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[str, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise DuplicateKey(f"key {key_node.value!r} is given twice in one mapping (lines "
                                   f"{seen[key_node.value]} and {line}); keep one")
            seen[key_node.value] = line
        return super().construct_mapping(node, deep)


class Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes exactly the strings :class:`Loader` would not read as strings."""

    yaml_implicit_resolvers: dict = {}


_BREAKS = ("\x85", "\u2028", "\u2029")  # line breaks to YAML: a quoted scalar would fold them to a space


def _represent_str(dumper: Dumper, text: str) -> yaml.ScalarNode:
    if any(b in text for b in _BREAKS):
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style='"')  # escaped, read back exactly
    return yaml.SafeDumper.represent_str(dumper, text)


Dumper.add_representer(str, _represent_str)

for _tag, _pattern, _first in _CORE_RESOLVERS:
    Loader.add_implicit_resolver(_tag, re.compile(_pattern), _first)
    Dumper.add_implicit_resolver(_tag, re.compile(_pattern), _first)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """Decimal, ``0o`` octal or ``0x`` hex; a leading zero is not octal (YAML 1.2)."""
    text = loader.construct_scalar(node)
    body = text.lstrip("+-")
    base = {"0o": 8, "0x": 16}.get(body[:2].lower(), 10)
    try:
        value = int(body[2:] if base != 10 else body, base)
    except ValueError:  # a malformed `!!int` or more digits than Python converts
        raise yaml.constructor.ConstructorError(None, None, f"cannot read {text[:40]!r} as an integer",
                                                node.start_mark) from None
    return -value if text.startswith("-") else value


Loader.add_constructor(_INT, _construct_int)


def load(text: str) -> Any:
    """Parse one YAML document with the core schema; raises ``yaml.YAMLError`` on bad syntax."""
    return yaml.load(text, Loader=Loader)


def dump(data: Any) -> str:
    """Block-style YAML of plain data, keys in insertion order; :func:`load` reads it back equal."""
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def plain_scalar(text: str) -> Any:
    """``text`` as a plain YAML 1.2 scalar, without YAML's tokenizer: null, bool, int and float as in
    the module docstring, anything else the string itself (``run #1``, ``a: b``, ``*x`` included)."""
    loader = Loader("")
    try:
        tag = loader.resolve(yaml.ScalarNode, text, (True, False))
        if tag not in (_NULL, _BOOL, _INT, _FLOAT):
            return text
        return loader.construct_object(yaml.ScalarNode(tag, text), deep=True)
    finally:
        loader.dispose()


def trailing_text(text: str) -> str:
    """What follows the last token of YAML ``text`` (a ``# comment`` the parser would drop), stripped."""
    end = 0
    for token in yaml.scan(text, Loader=Loader):
        if not isinstance(token, (yaml.StreamEndToken, yaml.DocumentEndToken)):
            end = max(end, token.end_mark.index)
    return text[end:].strip()

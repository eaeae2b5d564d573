"""``seqpar.verify``: the layout-equivalence check as a Python API (the code is in
:mod:`seqpar.tools.verify`; ``seqpar verify`` is its command line, docs/verify.md its page)."""
from .tools.verify import (DEFAULT_LAYOUTS, Layout, Report, Target, UserModel, assert_layouts_equal,  # noqa: F401
                           parse_layout, parse_layouts, resolve_target, verify)

__all__ = ["DEFAULT_LAYOUTS", "Layout", "Report", "Target", "UserModel", "assert_layouts_equal", "parse_layout",
           "parse_layouts", "resolve_target", "verify"]

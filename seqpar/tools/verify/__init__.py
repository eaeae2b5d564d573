"""``seqpar verify``: a model trains identically in every parallel layout (docs/verify.md)."""
from .layouts import DEFAULT_LAYOUTS, Layout, parse_layout, parse_layouts
from .report import Report
from .run import assert_layouts_equal, verify
from .target import Target, UserModel, resolve_target

__all__ = ["DEFAULT_LAYOUTS", "Layout", "Report", "Target", "UserModel", "assert_layouts_equal", "parse_layout",
           "parse_layouts", "resolve_target", "verify"]

"""The drop-in entry point, importable as a module: ``from seqpar.parallelize import parallelize,
Plan, Style`` (what converting a model needs; the rest of the drop-in API is in :mod:`seqpar.dropin`).

The code lives in :mod:`seqpar.dropin` (``tensor_parallel`` and ``spec``), beside the modules it
uses. ``import seqpar`` binds the name ``seqpar.parallelize`` to the *function*: the package
imports it from here, the way ``unittest.main`` is both a module and the callable its package
exports. So ``seqpar.parallelize(model, plan, mesh)`` calls it after ``import seqpar`` or
``import seqpar.parallelize`` alike, and ``import seqpar.parallelize as p`` gives the function.
"""
from .dropin.spec import Plan, Style
from .dropin.tensor_parallel import parallelize

__all__ = ["Plan", "Style", "parallelize"]

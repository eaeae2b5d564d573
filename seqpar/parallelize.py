"""``import seqpar.parallelize`` gives the function ``seqpar.parallelize`` (defined in
:mod:`seqpar.dropin.tensor_parallel`), not a module that would shadow it: this module replaces
itself in ``sys.modules`` by the function, so ``seqpar.parallelize`` stays callable however it
was imported."""
import sys

from .dropin.tensor_parallel import parallelize

sys.modules[__name__] = parallelize

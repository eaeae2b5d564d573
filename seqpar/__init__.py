"""seqpar: tensor + sequence parallelism and selective activation recomputation for PyTorch.

Implements Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198).

    mesh = seqpar.init_parallel(tp=2)                        # under torchrun
    model = seqpar.parallelize(model, seqpar.plans.gpt2(), mesh)   # an existing model, or
    model = seqpar.model.GPT(seqpar.model.GPTConfig(...), mesh)    # seqpar's own GPT

``seqpar.parallelize`` is a function and ``seqpar.plans`` the ready drop-in plans, both defined in
:mod:`seqpar.dropin`; ``import seqpar.parallelize`` and ``import seqpar.plans`` give the same
objects (registered below), so no module of that name shadows them.
"""
import sys

from .distributed.mesh import ParallelMesh, init_parallel
from .dropin import plans
from .dropin.tensor_parallel import parallelize

sys.modules[f"{__name__}.plans"] = plans
sys.modules[f"{__name__}.parallelize"] = parallelize  # type: ignore[assignment]  # the function, not a module

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "init_parallel", "parallelize", "plans", "__version__"]

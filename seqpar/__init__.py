"""seqpar: tensor + sequence parallelism and selective activation recomputation for PyTorch.

Implements Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198).

    mesh = seqpar.init_parallel(tp=2)                        # under torchrun
    model = seqpar.parallelize(model, seqpar.plans.gpt2(), mesh)   # an existing model, or
    model = seqpar.model.GPT(seqpar.model.GPTConfig(...), mesh)    # seqpar's own GPT

``seqpar.parallelize`` is a function (there is no ``seqpar.parallelize`` module); the drop-in
pieces live in :mod:`seqpar.dropin`.
"""
from . import plans
from .distributed.mesh import ParallelMesh, init_parallel
from .dropin.tensor_parallel import parallelize

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "init_parallel", "parallelize", "plans", "__version__"]

"""seqpar: tensor + sequence parallelism and selective activation recomputation for PyTorch.

Implements Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198).

    mesh = seqpar.init_parallel(tp=2)                        # under torchrun
    model = seqpar.parallelize(model, seqpar.plans.gpt2(), mesh)   # an existing model, or
    model = seqpar.model.GPT(seqpar.model.GPTConfig(...), mesh)    # seqpar's own GPT

``seqpar.parallelize`` is the function (imported from the module :mod:`seqpar.parallelize`, whose
name it then takes over in this namespace, as ``unittest.main`` does; the code is in
:mod:`seqpar.dropin`) and :mod:`seqpar.plans` the ready drop-in plans for Hugging Face models.
"""
from .distributed.mesh import ParallelMesh, init_parallel
from . import plans
from .parallelize import parallelize

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "init_parallel", "parallelize", "plans", "__version__"]

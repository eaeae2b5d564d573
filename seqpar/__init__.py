"""seqpar: tensor + sequence parallelism and selective activation recomputation for PyTorch.

Implements Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198).
"""
from .distributed.mesh import ParallelMesh, init_parallel

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "init_parallel", "__version__"]

"""The one home of seqpar's byte formulas and of the ledgers that measure them.

``formulas`` Table 2, §4.2.3 and §4.3 for the paper's shapes; ``whole_model`` the same terms as a
config runs them; ``schedule`` layers in flight for every pipeline schedule; ``params`` and
``state`` parameters and training-state bytes per rank (every precision x ddp / fsdp);
``transient`` what backward needs beyond the kept activations;
``ledger``, ``peak`` and ``probe`` what a forward pass, a pipeline step and a training run
really keep for backward.
"""
from .formulas import (
    GIB,
    PAPER_MODELS,
    SELECTIVE_DROPPED,
    TECHNIQUES,
    ModelShape,
    Technique,
    activation_breakdown,
    attention_score_share,
    bytes_per_layer,
    cross_entropy_terms,
    extra_bytes,
    first_stage_bytes,
    gib,
    interleave_factor,
    load_shape,
    paper_config_dir,
    paper_shapes,
    per_gpu_bytes,
    ratio_to_tp,
)
from .ledger import ActivationLedger, SavedTensor
from .peak import PeakActivationLedger
from .probe import ActivationProbe
from .schedule import layers_in_flight
from .state import state_bytes_formula, state_bytes_per_parameter
from .transient import backward_transient_bytes, context_block_bytes

__all__ = [
    "ActivationLedger", "ActivationProbe", "PeakActivationLedger", "SavedTensor",
    "GIB", "PAPER_MODELS", "SELECTIVE_DROPPED", "TECHNIQUES", "ModelShape", "Technique",
    "activation_breakdown", "attention_score_share", "backward_transient_bytes", "bytes_per_layer",
    "context_block_bytes", "cross_entropy_terms", "extra_bytes",
    "first_stage_bytes", "gib", "interleave_factor", "layers_in_flight", "load_shape", "paper_config_dir",
    "paper_shapes", "per_gpu_bytes", "ratio_to_tp", "state_bytes_formula", "state_bytes_per_parameter",
]

"""GPTConfig: the model's shape and its parallel / recompute modes, validated up front.

One decoder, configured: the defaults are GPT-2 (LayerNorm, learned positions, GeLU MLP,
multi-head attention); ``norm="rmsnorm"``, ``position="rope"``, ``mlp="swiglu"`` and
``kv_heads`` give the Llama family.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from ..errors import UserError
from .recompute_ops import check_recompute_ops
from .modes import (ATTENTION_MODES, RECOMPUTE_METHODS, RECOMPUTE_MODES, AttentionMode, RecomputeMethod, RecomputeMode,
                    RecomputeOp)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
T = TypeVar("T")


class Freezable:
    """A config dataclass that :func:`freeze` can make read-only (a resolved run's sections): then
    assigning or deleting a field raises :class:`dataclasses.FrozenInstanceError`. Until then it is
    an ordinary mutable dataclass; ``dataclasses.replace`` of a frozen one is a changeable copy."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: this {type(self).__name__} belongs to a resolved run and is "
                f"read-only (dataclasses.replace gives a copy that can change)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r} of a read-only {type(self).__name__}")
        object.__delattr__(self, name)


def _freeze_in_place(obj):
    """``obj`` with its nested config dataclasses frozen and its lists turned into tuples."""
    if isinstance(obj, list):
        return tuple(_freeze_in_place(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, _freeze_in_place(getattr(obj, f.name)))
        if isinstance(obj, Freezable):
            object.__setattr__(obj, "_frozen", True)
    return obj


def freeze(config: T) -> T:
    """A read-only deep copy of ``config`` (a :class:`Freezable` dataclass and every section it
    holds; lists become tuples): what a resolved run keeps, so nothing built from it can rewrite it.
    ``config`` itself is left as it was."""
    return _freeze_in_place(copy.deepcopy(config))


def _finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (Hugging Face ``rope_type: llama3``).

    Wavelengths ``2 pi / inv_freq`` shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept; longer than ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``; in between, interpolated linearly in ``original / wavelength``.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not _finite_positive(getattr(self, name)):
                raise UserError(f"RopeScaling.{name} must be a finite number > 0, got {getattr(self, name)!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise UserError(f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                            f"({self.low_freq_factor})")


ROUTERS = ("softmax", "sigmoid")


@dataclass
class MoEConfig(Freezable):
    """The ``model.moe`` section (off when ``GPTConfig.moe`` is None). Layer ``i`` is an MoE layer
    when ``i >= first_dense`` and ``(i + 1) % every == 0`` (Qwen3-MoE's ``decoder_sparse_step``).
    A router over ``experts`` experts picks ``top_k`` per token, in fp32. Experts use the model's
    MLP kind (SwiGLU for ``mlp="swiglu"``, else GeLU), without biases."""

    experts: int = 8               # E routed experts per MoE layer
    top_k: int = 2                 # k experts per token
    ffn_hidden: int | None = None  # each expert's width f_e; None: the model's ffn_hidden
    shared_experts: int = 0        # always-on experts (DeepSeek-V3), one MLP of width shared_experts x f_e
    every: int = 1                 # layer i is MoE when (i + 1) % every == 0 ...
    first_dense: int = 0           # ... and i >= first_dense (DeepSeek-V3: the first 3 layers dense)
    # softmax: top-k of softmax(logits) (Mixtral, Qwen3-MoE); sigmoid: top-k of sigmoid(logits) +
    # bias, the bias moved after each step towards balanced load (DeepSeek-V3's aux-loss-free balancing)
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk: bool = True         # the k routing weights divided by their sum
    route_scale: float = 1.0       # routing weights multiplied by this (DeepSeek-V3: 2.5)
    aux_loss_coeff: float = 0.0    # load-balancing loss E/k * sum_e f_e P_e, over each micro-batch
    z_loss_coeff: float = 0.0      # router z-loss: mean over tokens of logsumexp(logits)^2
    bias_update_rate: float = 0.0  # sigmoid router: bias_e += rate * sign(mean load - load_e) per step
    # None: dropless; else each expert takes at most ceil(capacity_factor * tokens * k / E) of a
    # micro-batch's assignments (earliest tokens first), the rest dropped and counted
    capacity_factor: float | None = None
    # split each expert's width over the TP ranks (expert-TP = t: tokens all-gathered over TP into the
    # experts, outputs reduce-scattered back) instead of every TP rank holding whole experts (expert-TP = 1)
    expert_tp: bool = False
    # recompute each expert's fc1 and activation in backward instead of keeping the activation's input
    # (2 m f bytes per routed row in bf16 for SwiGLU saved, one fc1 GEMM per routed row recomputed)
    recompute_experts: bool = False

    def validate(self) -> None:
        for name in ("experts", "top_k", "every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"MoEConfig.{name} must be a positive integer, got {v!r}")
        for name in ("shared_experts", "first_dense"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"MoEConfig.{name} must be an integer >= 0, got {v!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1):
            raise UserError(f"MoEConfig.ffn_hidden must be a positive integer or null, got {self.ffn_hidden!r}")
        if self.top_k > self.experts:
            raise UserError(f"MoEConfig.top_k ({self.top_k}) exceeds experts ({self.experts})")
        if self.router not in ROUTERS:
            raise UserError(f"MoEConfig.router must be one of {ROUTERS}, got {self.router!r}")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise UserError(f"MoEConfig.{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.route_scale, (int, float)) and math.isfinite(self.route_scale) and self.route_scale > 0):
            raise UserError(f"MoEConfig.route_scale must be a finite number > 0, got {self.route_scale!r}")
        if self.bias_update_rate > 0 and self.router != "sigmoid":
            raise UserError(f"MoEConfig.bias_update_rate={self.bias_update_rate} balances the sigmoid router; "
                            f"router is {self.router!r}")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and math.isfinite(cf) and cf > 0):
            raise UserError(f"MoEConfig.capacity_factor must be a finite number > 0 or null, got {cf!r}")
        if cf is not None and self.expert_tp:
            raise UserError(f"MoEConfig.capacity_factor={cf} with expert_tp=true is not supported yet")

    def is_moe_layer(self, i: int) -> bool:
        """Whether transformer layer ``i`` (0-based) has an MoE FFN."""
        return i >= self.first_dense and (i + 1) % self.every == 0

    def moe_layer_count(self, layers: int) -> int:
        """How many of ``layers`` layers have an MoE FFN (:meth:`is_moe_layer`), without a loop."""
        return max(0, layers // self.every - self.first_dense // self.every)

    def expert_ffn(self, model_ffn: int) -> int:
        """f_e: each expert's width (``ffn_hidden``, else the model's)."""
        return self.ffn_hidden or model_ffn

    def check_experts_parallel(self, ep: int) -> None:
        """The experts split evenly over ``ep`` expert-parallel ranks."""
        if self.experts % ep:
            raise UserError(f"model.moe.experts ({self.experts}) is not divisible by parallel.ep={ep}")


def swiglu_ffn(hidden: int) -> int:
    """Llama's SwiGLU width for ``hidden``: 8h/3 rounded up to a multiple of 256 (4096 -> 11008)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


@dataclass
class GPTConfig(Freezable):
    """A GPT-2/GPT-3 or Llama-family decoder. Every check that needs only these numbers runs in
    ``validate()``; the ones that need the TP size run in ``check_parallel(t)``."""

    vocab_size: int = 50304        # the tokenizer's vocabulary, any size (padded inside, see vocab_multiple)
    seq_len: int = 1024            # maximum sequence length (learned positions; the RoPE window)
    hidden: int = 768              # h
    heads: int = 12                # a (query heads); h must be divisible by a
    layers: int = 12               # L
    ffn_hidden: int | None = None  # MLP width f; None: 4h (gelu), Llama's 8h/3 rounded up to 256 (swiglu)
    dropout: float = 0.1           # embedding, post-attention and post-MLP dropout
    attention_dropout: float = 0.1 # dropout on the attention probabilities
    activation: Literal["gelu", "gelu_tanh"] = "gelu"  # the GeLU of mlp="gelu" (swiglu uses SiLU)
    tie_embeddings: bool = True    # output head shares the token-embedding table
    layernorm_eps: float = 1e-5    # epsilon of the norms (LayerNorm or RMSNorm)
    bias: bool = True              # biases in the linear layers (GPT-2 has them, Llama not)
    init_std: float = 0.02         # normal init; residual output projections get std / sqrt(2L)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position: Literal["learned", "rope"] = "learned"  # learned table [seq_len, h], or rotary on q and k
    rope_theta: float = 10000.0    # RoPE base (Llama 2: 1e4, Llama 3: 5e5)
    rope_scaling: RopeScaling | None = None  # Llama 3.1/3.2's scaling of the RoPE frequencies
    mlp: Literal["gelu", "swiglu"] = "gelu"  # fc1 -> GeLU -> fc2, or fc2(silu(gate) * up)
    kv_heads: int | None = None    # key/value heads g (grouped-query attention); None: g = a
    vocab_multiple: int = 1        # embedding/output rows padded to a multiple of vocab_multiple x t
    sequence_parallel: bool = True # shard norms/dropout/residual along the sequence (needs t | seq)
    # auto: per-layer modes chosen by seqpar.plan.resolve_recompute under train.memory_budget_gib
    recompute: Literal[RecomputeMode, "auto"] = "selective"
    recompute_method: RecomputeMethod = "uniform"  # full only: N-layer groups, or first N layers
    recompute_num_layers: int = 1  # N for full recompute
    # per-layer modes, one per layer; when set they override recompute (each full layer is its own
    # checkpointed unit; recompute_method / recompute_num_layers are then unused)
    recompute_layers: tuple[RecomputeMode, ...] | None = None
    # op-level choices in every none / selective layer (seqpar.model.recompute_ops): norm (the norm outputs),
    # activation (the GeLU / SwiGLU output), dropout (the two dropout masks), rebuilt in backward;
    # under recompute: auto the choices auto may take (it keeps the subset it takes)
    recompute_ops: tuple[RecomputeOp, ...] = ()
    attention: AttentionMode = "math"  # sdpa: PyTorch's fused kernels
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # parameter/activation dtype
    qk_norm: bool = False          # Qwen3: RMSNorm over each q and k head before RoPE (needs g >= t)
    moe: MoEConfig | None = None  # mixture-of-experts FFNs (seqpar.model.moe_config); None: dense MLPs

    def __post_init__(self) -> None:
        if self.ffn_hidden is None and isinstance(self.hidden, int):
            self.ffn_hidden = swiglu_ffn(self.hidden) if self.mlp == "swiglu" else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        """g: key/value heads (``heads`` unless grouped-query attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def held_kv_heads(self, t: int) -> int:
        """Key/value heads the ``t`` TP ranks hold together: ``g`` when ``t`` divides ``g``, else ``t``
        (each rank then holds one head, replicated over the ``t / g`` ranks whose queries use it)."""
        return max(self.num_kv_heads, t)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def padded_vocab(self, t: int = 1) -> int:
        """Rows of the embedding and output layer at TP size ``t``: ``vocab_size`` rounded up to a
        multiple of ``vocab_multiple x t``. The extra rows are zero and their logits masked to -inf."""
        m = self.vocab_multiple * t
        return -(-self.vocab_size // m) * m

    def validate(self) -> None:
        """Raise :class:`~seqpar.errors.UserError` naming the values of any inconsistent field."""
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "ffn_hidden", "recompute_num_layers",
                     "vocab_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"GPTConfig.{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise UserError(f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        for name in ("dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise UserError(f"GPTConfig.{name} must be in [0, 1), got {p}")
        if not 0 < self.layernorm_eps < float("inf"):  # NaN fails too; 0 divides by zero on a constant row
            raise UserError(f"GPTConfig.layernorm_eps must be a finite number > 0, got {self.layernorm_eps!r}")
        if not 0 <= self.init_std < float("inf"):
            raise UserError(f"GPTConfig.init_std must be a finite number >= 0, got {self.init_std!r}")
        choices = {"activation": ("gelu", "gelu_tanh"), "recompute": (*RECOMPUTE_MODES, "auto"),
                   "recompute_method": RECOMPUTE_METHODS, "attention": ATTENTION_MODES, "dtype": tuple(DTYPES),
                   "norm": ("layernorm", "rmsnorm"), "position": ("learned", "rope"), "mlp": ("gelu", "swiglu")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.recompute == "full" and self.recompute_num_layers > self.layers:
            raise UserError(f"GPTConfig.recompute_num_layers ({self.recompute_num_layers}) exceeds layers "
                            f"({self.layers})")
        self._validate_recompute_layers()
        self._validate_recompute_ops()
        self._validate_llama_options()
        if self.moe is not None:
            self.moe.validate()

    def _validate_recompute_layers(self) -> None:
        modes = self.recompute_layers
        if modes is None:
            return
        if not isinstance(modes, (list, tuple)) or any(m not in RECOMPUTE_MODES for m in modes):
            raise UserError(f"GPTConfig.recompute_layers must be a list of {list(RECOMPUTE_MODES)}, got {modes!r}")
        if len(modes) != self.layers:
            raise UserError(f"GPTConfig.recompute_layers has {len(modes)} entries but layers is {self.layers} "
                            f"(model.recompute_layers needs one mode per layer of model.layers)")

    def _validate_recompute_ops(self) -> None:
        """``recompute_ops``: known, distinct values, in layers that are not all ``full``."""
        try:
            ops = check_recompute_ops(self.recompute_ops)
        except ValueError as e:
            raise UserError(str(e)) from None
        if not ops:
            return
        modes = self.recompute_layers
        if (modes is None and self.recompute == "full") or (modes is not None and all(m == "full" for m in modes)):
            raise UserError(f"model.recompute_ops={list(ops)} means nothing with full recompute (a full layer keeps "
                            f"only its input); use model.recompute none or selective, or per-layer modes with "
                            f"some none / selective layers")
        if "dropout" in ops and self.dropout == 0:
            raise UserError("model.recompute_ops has 'dropout' but model.dropout=0 keeps no dropout masks")
        if self.moe is not None:
            raise UserError(f"model.recompute_ops={list(ops)} with model.moe is not supported yet (an MoE layer "
                            f"has model.moe.recompute_experts)")

    def layer_recompute(self) -> tuple[str, ...] | None:
        """The per-layer modes the model runs: ``recompute_layers`` if set, else ``None`` (uniform
        ``recompute``). ``recompute: auto`` without them raises: resolve it first."""
        if self.recompute_layers is not None:
            return tuple(self.recompute_layers)
        if self.recompute == "auto":
            raise UserError("GPTConfig.recompute='auto' has no per-layer modes yet: resolve it with "
                            "seqpar.plan.resolve_recompute (needs train.memory_budget_gib), or set "
                            "model.recompute_layers")
        return None

    def _validate_llama_options(self) -> None:
        g = self.kv_heads
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1 or self.heads % g):
            raise UserError(f"GPTConfig.kv_heads ({g!r}) must be a positive integer dividing heads ({self.heads})")
        if self.position == "rope":
            if self.head_dim % 2:
                raise UserError(f"GPTConfig.position='rope' needs an even head dim; hidden ({self.hidden}) / "
                                f"heads ({self.heads}) = {self.head_dim}")
            if not _finite_positive(self.rope_theta):
                raise UserError(f"GPTConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}")
            if self.rope_scaling is not None:
                self.rope_scaling.validate()
        elif self.rope_scaling is not None:
            raise UserError(f"GPTConfig.rope_scaling is set but position is {self.position!r} (it needs 'rope')")
        if self.mlp == "swiglu" and self.activation != "gelu":
            raise UserError(f"GPTConfig.activation={self.activation!r} applies to mlp='gelu'; mlp='swiglu' uses "
                            f"SiLU (leave activation at 'gelu')")

    def check_parallel(self, t: int) -> None:
        """Every dimension that TP/SP splits must be divisible by ``t``; raised on every rank
        before any collective, with all offending values in one message. The vocabulary is
        padded instead (:meth:`padded_vocab`), so it may have any size."""
        self.validate()
        bad = [f"{name} ({getattr(self, name)})" for name in ("heads", "hidden", "ffn_hidden")
               if getattr(self, name) % t]
        moe = self.moe
        if moe is not None and (moe.shared_experts or moe.expert_tp) and moe.expert_ffn(self.ffn_hidden) % t:
            bad.append(f"moe.ffn_hidden ({moe.expert_ffn(self.ffn_hidden)}, the shared or expert-TP experts' width)")
        if self.sequence_parallel and self.seq_len % t:
            bad.append(f"seq_len ({self.seq_len}, sequence parallelism)")
        if bad:
            raise UserError(f"GPTConfig: not divisible by the tensor-parallel size t={t}: {', '.join(bad)}")
        g = self.kv_heads
        if self.qk_norm and self.num_kv_heads < t:
            raise UserError(f"GPTConfig.qk_norm with kv_heads ({self.num_kv_heads}) < t={t} is not supported: each "
                            f"key head would be replicated and its norm's gradient counted t/kv_heads times")
        if g is not None and g % t and t % g:  # g < t: each head replicated over the t/g ranks using it
            raise UserError(f"GPTConfig: kv_heads ({g}; heads={self.heads}) and the tensor-parallel size t={t}: "
                            f"t must divide kv_heads (each rank holds kv_heads/t heads) or be a multiple of it "
                            f"(each head replicated over t/kv_heads ranks)")

"""Activation recomputation, RNG-exact (paper §5).

* ``selective``: only the attention core (QK^T, softmax, softmax dropout, attention over V) is
  recomputed. It holds the ``5as/h`` share of activation memory at ``4Bs^2h`` FLOPs per layer.
* ``full``: whole transformer blocks are recomputed; only each checkpointed unit's input is kept.
  ``uniform`` checkpoints groups of N consecutive layers (a trailing group may be smaller);
  ``block`` checkpoints each of the first N layers and keeps the rest.
* per layer (``model.recompute_layers``): each layer none / selective / full; every full layer is
  its own checkpointed unit (:func:`per_layer_runs`).

:func:`checkpoint` snapshots the CPU, CUDA and seqpar dropout-stream RNG states at forward time
and replays them for the recomputation, so the recomputed dropout masks are the ones the
forward pass used. It keeps its tensor inputs through ``save_for_backward`` (visible to
``saved_tensors_hooks``, so the memory ledger sees exactly what recomputation keeps).

The same RNG state gives the same mask only from the same kernel: PyTorch picks a
``scaled_dot_product_attention`` kernel partly from whether grad is on (on sm86/89/120 flash is
refused for training with head_dim > 192), and a checkpoint's first pass runs without grad while
its replay runs with it. :func:`replayable_sdpa` picks the kernel the grad-on pass would, for
both passes. A compiled block cannot swap generator states, so there the fused kernel's dropout
runs inside one op, :func:`stream_sdpa` (``seqpar::stream_sdpa``), that takes the stream's state
and returns the next: the eager mask, replayed exactly by recomputation.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Literal, Sequence, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .distributed.rng import RNGStreams, capture_rng, replay_rng, run_with_state

RecomputeMode = Literal["none", "selective", "full"]  # what one layer keeps or recomputes
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)
RecomputeMethod = Literal["uniform", "block"]  # full recompute: groups of N layers, or the first N layers
RECOMPUTE_METHODS: tuple[RecomputeMethod, ...] = get_args(RecomputeMethod)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_fn, streams, *args):
        ctx.run_fn, ctx.streams = run_fn, streams
        ctx.rng = capture_rng(streams)
        dev = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            out = run_fn(*args)
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_idx))
        return out

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        saved = ctx.saved_tensors
        for i, t in zip(ctx.tensor_idx, saved):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        dev, ac_on, ac_dtype = ctx.autocast
        with replay_rng(ctx.rng, ctx.streams), torch.enable_grad(), \
                torch.autocast(device_type=dev, dtype=ac_dtype, enabled=ac_on):
            out = ctx.run_fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(args[i].grad if i in ctx.tensor_idx else None for i in range(len(args))))


def checkpoint(run_fn: Callable, *args, streams: RNGStreams | None = None):
    """Run ``run_fn(*args)`` without keeping its activations; recompute them in backward with the
    same RNG states. Only the tensor ``args`` are kept. Outside autograd (no grad needed, or
    ``torch.no_grad``) it just calls ``run_fn``."""
    if not torch.is_grad_enabled() or not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return run_fn(*args)
    return _Checkpoint.apply(run_fn, streams, *args)


def run_layers(runs: Sequence[tuple[int, int, bool]], run_blocks: Callable, x: torch.Tensor,
               streams: RNGStreams | None = None) -> torch.Tensor:
    """Run the layer runs ``(start, end, checkpointed)`` of a recompute setting (:func:`checkpoint_runs`,
    :func:`per_layer_runs`) through ``run_blocks(x, start, end)``; a checkpointed run keeps only
    its input and replays ``streams`` when recomputed."""
    for begin, end, ckpt in runs:
        x = checkpoint(run_blocks, x, begin, end, streams=streams) if ckpt else run_blocks(x, begin, end)
    return x


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                 is_causal: bool = False, enable_gqa: bool = False) -> SDPBackend:
    """The kernel ``scaled_dot_product_attention`` runs for these inputs when grad is on (as in a
    recomputation's replay, and in a plain training forward). Grad only ever rules kernels out, so
    this one also runs in a no-grad first pass. With dropout it chooses as for inputs that need grad
    (a compiled graph's are detached), so the op a compiled block runs draws the eager step's mask.
    Respects an enclosing ``sdpa_kernel`` choice."""
    dev = q.device.type
    if dropout_p > 0 and not q.requires_grad:
        q, k, v = (x.detach().requires_grad_(x.is_floating_point()) for x in (q, k, v))
    with torch.enable_grad():
        if torch.is_autocast_enabled(dev) and q.dtype != torch.get_autocast_dtype(dev):
            # the kernel sees autocast's copies: choose for those (a transient copy, autocast makes it anyway)
            q, k, v = (x.to(torch.get_autocast_dtype(dev)) for x in (q, k, v))
        choice = torch._fused_sdp_choice(q, k, v, None, dropout_p, is_causal, enable_gqa=enable_gqa)
    return SDPBackend(choice)


def replayable_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` pinned to :func:`sdpa_backend`'s kernel, so a checkpoint's
    no-grad first pass and its grad-on replay run the same kernel and draw the same dropout mask.
    ``[b, heads, s, d]`` in and out. Under ``torch.compile`` the kernel is fixed at trace time."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    if torch.compiler.is_compiling() or not hasattr(torch, "_fused_sdp_choice"):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, **kw)
    with sdpa_kernel([sdpa_backend(q, k, v, dropout_p, is_causal, enable_gqa)]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, **kw)


# ----------------------------------------------------------------------------- fused attention dropout
# A compiled block cannot swap generator states, so there the fused kernel's dropout runs inside one
# custom op that takes the stream's state as an input and returns the state after: a pure function
# of it, so recomputation (which replays the saved state) and the eager step draw the same mask.
def _drawn_sdpa(q: Tensor, k: Tensor, v: Tensor, p: float, enable_gqa: bool, state: Tensor) -> tuple[Tensor, Tensor]:
    """Causal :func:`replayable_sdpa` with dropout ``p`` drawn from generator state ``state``;
    returns the output and the state after the draw (the eager step's ``fork`` draws the same)."""
    with torch.autocast(q.device.type, enabled=False):  # the caller has cast to autocast's dtype
        return run_with_state(q.device, state, lambda: replayable_sdpa(q, k, v, dropout_p=p, is_causal=True,
                                                                      enable_gqa=enable_gqa))


@torch.library.custom_op("seqpar::stream_sdpa", mutates_args=())
def _stream_sdpa(q: Tensor, k: Tensor, v: Tensor, p: float, enable_gqa: bool, state: Tensor) -> tuple[Tensor, Tensor]:
    out, after = _drawn_sdpa(q, k, v, p, enable_gqa, state)
    return out.contiguous(), after  # the layout the fake kernel promises (kernels differ)


@torch.library.custom_op("seqpar::stream_sdpa_backward", mutates_args=())
def _stream_sdpa_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, p: float, enable_gqa: bool,
                          state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's forward again from the saved state (the same mask), then its backward."""
    _, vjp = torch.func.vjp(lambda *qkv: _drawn_sdpa(*qkv, p, enable_gqa, state)[0], q, k, v)
    return tuple(g.contiguous() for g in vjp(grad.to(q.dtype)))  # type: ignore[return-value]


@_stream_sdpa.register_fake
def _(q, k, v, p, enable_gqa, state):
    return q.new_empty(q.shape), torch.empty_like(state)


@_stream_sdpa_backward.register_fake
def _(grad, q, k, v, p, enable_gqa, state):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _sdpa_setup(ctx, inputs, output):
    q, k, v, ctx.p, ctx.enable_gqa, state = inputs
    ctx.save_for_backward(q, k, v, state)  # the kernel's own residuals are recomputed from these


def _sdpa_backward(ctx, grad, grad_state):
    q, k, v, state = ctx.saved_tensors
    dq, dk, dv = torch.ops.seqpar.stream_sdpa_backward(grad, q, k, v, ctx.p, ctx.enable_gqa, state)
    return dq, dk, dv, None, None, None


_stream_sdpa.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


def stream_sdpa(q: Tensor, k: Tensor, v: Tensor, p: float, streams: RNGStreams, name: str = "tp", *,
                enable_gqa: bool = False) -> Tensor:
    """Causal ``scaled_dot_product_attention`` of ``[b, heads, s, d]`` q, k, v with dropout ``p``
    drawn from stream ``name``, as one op (``seqpar::stream_sdpa``) that ``torch.compile`` traces
    without a graph break: the same kernel (:func:`replayable_sdpa`) and generator state as the
    eager step's ``streams.fork(name)``, hence the same mask and output. It keeps q, k, v and the
    stream state, and its backward runs the kernel's forward once more (the same mask) before the
    kernel's backward: one attention forward more than eager, paid only with attention dropout."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev) and q.dtype != torch.get_autocast_dtype(dev):
        q, k, v = (x.to(torch.get_autocast_dtype(dev)) for x in (q, k, v))  # what sdpa under autocast runs on
    out, after = torch.ops.seqpar.stream_sdpa(q, k, v, p, enable_gqa, streams.states[name])
    streams.advance(name, after)
    return out


def checkpoint_runs(layers: int, method: RecomputeMethod, num_layers: int) -> list[tuple[int, int, bool]]:
    """Split ``range(layers)`` into runs ``(start, end, checkpointed)``.

    uniform, N=2, L=5 -> [(0,2,T), (2,4,T), (4,5,T)]; block, N=2, L=5 -> [(0,1,T), (1,2,T), (2,5,F)].
    """
    if num_layers < 1:
        raise ValueError(f"recompute_num_layers must be >= 1, got {num_layers}")
    if method == "uniform":
        return [(s, min(s + num_layers, layers), True) for s in range(0, layers, num_layers)]
    if method == "block":
        n = min(num_layers, layers)
        return [(i, i + 1, True) for i in range(n)] + ([(n, layers, False)] if n < layers else [])
    raise ValueError(f"recompute_method must be 'uniform' or 'block', got {method!r}")


def per_layer_runs(modes: Sequence[str]) -> list[tuple[int, int, bool]]:
    """Runs ``(start, end, checkpointed)`` of a per-layer list: each ``full`` layer a checkpointed
    run of its own, consecutive other layers one plain run.

    ["none", "full", "full", "selective", "none"] -> [(0,1,F), (1,2,T), (2,3,T), (3,5,F)].
    """
    runs: list[tuple[int, int, bool]] = []
    for i, mode in enumerate(modes):
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"per-layer recompute mode {i} must be one of {RECOMPUTE_MODES}, got {mode!r}")
        if mode != "full" and runs and not runs[-1][2]:
            runs[-1] = (runs[-1][0], i + 1, False)
        else:
            runs.append((i, i + 1, mode == "full"))
    return runs


def recompute_runs(mode: str | Sequence[str], layers: int, method: RecomputeMethod = "uniform",
                   num_layers: int = 1) -> tuple[tuple[str, ...], list[tuple[int, int, bool]]]:
    """``(one mode per layer, runs)`` of a recompute setting for ``layers`` layers: a mode for every
    layer ("none", "selective", "full" in ``method`` groups of ``num_layers``), or a list of them
    (each full layer a checkpointed run of its own)."""
    if isinstance(mode, str):
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
        runs = checkpoint_runs(layers, method, num_layers) if mode == "full" else [(0, layers, False)]
        return (mode,) * layers, runs
    modes = tuple(mode)
    if len(modes) != layers:
        raise ValueError(f"per-layer recompute needs one mode per layer: got {len(modes)} for {layers} layers")
    return modes, per_layer_runs(modes)


# ----------------------------------------------------------------------------- compiled blocks
# Under torch.compile a transformer block runs inside torch.utils.checkpoint with a selective
# checkpoint policy the compiler honours: every op of the attention core is recomputed
# (selective), everything else is saved, exactly as the eager step keeps it (none). The min-cut
# partitioner would otherwise pick its own recomputation and change Table 2's bytes.
# the stream state a dropout advances is a side effect inside the checkpointed region; it must
# happen once (forward), never again in recomputation
COMPILE_OPTIONS = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
COMPILED_MARK = "_seqpar_compiled_block"  # set on the forward seqpar.parallel.compile gives a block


def is_compiled_block(module) -> bool:
    """Whether ``module``'s forward is a compiled block's (:mod:`seqpar.parallel.compile`)."""
    return module is not None and bool(getattr(module.__dict__.get("forward"), COMPILED_MARK, False))


def compile_unsupported(config, cp: int = 1) -> str | None:
    """Why blocks of ``config`` (a GPTConfig) at context-parallel size ``cp`` cannot be compiled yet,
    or None: ``train.compile=auto`` runs such a run eagerly, ``true`` refuses it with this line."""
    missing = [k for k in COMPILE_OPTIONS if not hasattr(torch._dynamo.config, k)]
    if missing:
        return (f"train.compile needs a PyTorch whose torch._dynamo.config has {missing} (this is "
                f"{torch.__version__}); upgrade PyTorch or set train.compile=false")
    ops = tuple(getattr(config, "recompute_ops", ()))
    custom = [f"{op} with {key}={getattr(config, key)}" for op, key, eager_only in
              (("norm", "norm", "rmsnorm"), ("activation", "mlp", "swiglu"), ("norm", "qk_norm", True))
              if op in ops and getattr(config, key) == eager_only]
    if custom:
        return (f"train.compile does not support model.recompute_ops {custom} yet: a compiled block rebuilds "
                f"only LayerNorm's and GeLU's outputs (dropout is supported everywhere)")
    if cp > 1:
        return (f"train.compile supports parallel.cp = 1 only (got cp={cp}): context-parallel attention "
                f"exchanges K/V with point-to-point calls the compiler does not trace yet")
    return None


_SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "scaled_dot_product_attention")


def attention_core_ops() -> frozenset:
    """The aten (and seqpar) ops of :class:`seqpar.model.attention.CoreAttention`: QK^T with the
    causal bias, softmax, the core's dropout, attention over V, and the fused SDPA kernels."""
    aten = torch.ops.aten
    ops = {aten.baddbmm.default, aten.bmm.default, aten._softmax.default, aten.softmax.int,
           torch.ops.seqpar.core_dropout.default}
    ops.update(getattr(aten, name).default for name in _SDPA_KERNELS if hasattr(aten, name))
    return frozenset(ops)


def sequence_gather_ops() -> frozenset:
    """The traced form of the SP all-gather (g) and of waiting on it. A column-parallel layer keeps
    only its sequence shard and gathers again in backward (§4.2.2); saving the gathered tensor
    instead would keep ``t`` times the bytes, so a compiled block recomputes the gather."""
    ops = set()
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_gather_into_tensor", "wait_tensor"):
        packet = getattr(functional, name, None) if functional is not None else None
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


def dtype_cast_ops() -> frozenset:
    """Casts between dtypes. Inductor's decompositions (LayerNorm, GeLU in bf16) upcast their input
    to fp32 and would keep the fp32 copy, twice the bytes of the bf16 tensor the eager op keeps:
    a compiled block recomputes casts where that keeps less."""
    return frozenset({torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default})


def rebuilt_ops(ops: Sequence[str]) -> frozenset:
    """The aten ops a compiled block recomputes for ``model.recompute_ops`` ``ops`` (the eager block
    rebuilds their outputs through :func:`seqpar.model.recompute_ops.recompute_output`): LayerNorm for
    ``norm``, GeLU for ``activation``. Each appears in a block only as that norm or activation."""
    aten = torch.ops.aten
    table = {"norm": (aten.native_layer_norm.default,), "activation": (aten.gelu.default,)}
    return frozenset(op for name in ops for op in table.get(name, ()))


def block_policy(mode: RecomputeMode, low_precision: bool = False, ops: tuple[str, ...] = ()) -> Callable:
    """The selective-checkpoint policy of a compiled block at recompute ``mode`` ("none" or
    "selective"; a full layer is checkpointed around its compiled block by :func:`checkpoint`),
    with ``model.recompute_ops`` ``ops`` (:func:`rebuilt_ops` recomputed too).

    Everything outside the attention core is saved as the eager step saves it (``MUST_SAVE``),
    except with ``low_precision`` (bf16 / fp16 activations): Inductor decomposes LayerNorm and GeLU
    into fp32 math after the policy has tagged them, and a forced save keeps the fp32 upcast (twice
    the bytes); there those ops are only preferred saved, so the partitioner keeps the bf16 tensor
    and recomputes the cast (and may recompute other cheap pointwise ops: docs/training.md)."""
    if mode not in ("none", "selective"):
        raise ValueError(f"a compiled block's own policy is 'none' or 'selective', got {mode!r}")
    core = (attention_core_ops() if mode == "selective" else frozenset()) | rebuilt_ops(ops)
    cheap = sequence_gather_ops() | dtype_cast_ops()

    def policy(ctx, op, *args, **kwargs):
        if op in core:
            return CheckpointPolicy.MUST_RECOMPUTE
        if op in cheap:  # the SP gather again in backward, as the eager layers do; casts
            return CheckpointPolicy.PREFER_RECOMPUTE
        return keep
    keep = CheckpointPolicy.PREFER_SAVE if low_precision else CheckpointPolicy.MUST_SAVE
    return policy


_REBUILT = ((), ("norm",), ("activation",), ("norm", "activation"))  # the compiled blocks' own choices
_POLICIES: dict[tuple[str, bool, tuple[str, ...]], Callable] = {
    (mode, low, ops): block_policy(mode, low, ops) for mode in ("none", "selective") for low in (False, True)
    for ops in _REBUILT}  # built untraced


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_region(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` keeping only ``args``, every op recomputed in backward: the compiled form of
    :func:`checkpoint` (a selective-checkpoint policy the compiler honours). Random ops inside draw
    from the default generator; seqpar's own dropout replays its saved stream state."""
    context = partial(create_selective_checkpoint_contexts, _recompute_everything)
    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context)


def run_with_policy(fn: Callable, x: torch.Tensor, mode: RecomputeMode, ops: tuple[str, ...] = ()) -> torch.Tensor:
    """``fn(x)`` under ``mode``'s selective-checkpoint policy with the block's rebuilt ``ops``
    ("norm", "activation": :func:`rebuilt_ops`) (traced by torch.compile as one region; the stream
    states a dropout advances are advanced once, in forward)."""
    low = x.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(x.device.type)
    rebuilt = tuple(op for op in ("norm", "activation") if op in ops)
    context = partial(create_selective_checkpoint_contexts, _POLICIES[(mode, low, rebuilt)])
    return torch_checkpoint(fn, x, use_reentrant=False, context_fn=context)

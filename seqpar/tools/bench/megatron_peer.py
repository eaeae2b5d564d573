"""Megatron-LM core (``megatron-core`` 0.16.1) as a benchmark peer: its ``GPTModel`` with the local
(non-TransformerEngine) layer spec, loaded from seqpar's dense weights.

Megatron-core targets CUDA; a few small patches (:func:`patch_targets`) let it run on CPU gloo
without changing what it computes. They are in force only inside :class:`MegatronPeer`'s own
calls (:func:`megatron_patches`) and undone after each. Imported only by the bench runner, never
by seqpar.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from ...distributed.collectives import all_reduce_coalesced, backend_of, group_ranks, world_group
from ...memory import ActivationLedger
from ...model.modes import RECOMPUTE_MODES
from ...sharding import copy_into, interleave
from .peer import BenchShape, Recompute

LAYER_PATTERN = r"decoder\.layers\.\d+"  # Megatron's transformer layers: decoder.layers.3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MISSING = object()


# ---------------------------------------------------------------------------------------- patches
def _sp_norm_new(original_new):
    """``WrappedTorchNorm.__new__`` accepting sequence parallelism. Megatron's plain-torch norm
    wrapper (used by the local spec when neither TransformerEngine nor Apex is installed) refuses
    ``sequence_parallel``. Under SP a norm is an ordinary LayerNorm over this rank's ``[s/t, b, h]``
    rows, so build it as if SP were off and tag its parameters ``sequence_parallel`` (Megatron's
    convention for weights whose gradients are partial per rank);
    :meth:`MegatronPeer._allreduce_sp_grads` then sums those over TP."""

    def new(cls, config, hidden_size, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False  # only for the wrapper's check; restored below
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    return staticmethod(new)


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _add_cpu_rng_state(self, name, seed) -> None:
    """``CudaRNGStatesTracker.add`` seeding a CPU generator state instead of a CUDA one."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def patch_targets(cpu: bool) -> list[tuple[object, str, object]]:
    """``(owner, attribute, replacement)`` for every patch :func:`megatron_patches` applies.

    Always: the plain-torch norm accepts sequence parallelism (:func:`_sp_norm_new`). With
    ``cpu``, what makes megatron-core run on CPU gloo without changing what it computes:

    1. CUDA RNG state -> CPU generator: ``tensor_parallel.random``'s ``_get_cuda_rng_state`` /
       ``_set_cuda_rng_state`` and ``CudaRNGStatesTracker.add`` read, write and seed the CPU default
       generator, so the RNG tracker (``model_parallel_cuda_manual_seed``, ``fork()``) and the
       checkpoint functions of selective / full recomputation save and restore the generator that
       CPU dropout draws from.
    2. ``torch.cuda.current_device()`` answers ``torch.device("cpu")``: Megatron allocates its
       communication buffers (SP all-gather / reduce-scatter outputs, the attention-score buffer)
       on "the current device".
    """
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    targets = [(WrappedTorchNorm, "__new__", _sp_norm_new(WrappedTorchNorm.__new__))]
    if cpu:
        targets += [(mrandom, "_get_cuda_rng_state", _cpu_rng_state),
                    (mrandom, "_set_cuda_rng_state", _set_cpu_rng_state),
                    (mrandom.CudaRNGStatesTracker, "add", _add_cpu_rng_state),
                    (torch.cuda, "current_device", _cpu_device)]
    return targets


# what Megatron-LM core warns about that does not apply to the benchmark: optional fused kernels not
# installed (their local fallbacks are what it measures), a default of its own config, and its own
# calls to torch's renamed collectives; on the CPU also its CUDA_DEVICE_MAX_CONNECTIONS advice
_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
            "full scope is deprecated", r"`torch\.distributed\.\w+` is deprecated")
_CPU_NOTICES = ("When using sequence parallelism it is recommended to set the environment variable "
                "CUDA_DEVICE_MAX_CONNECTIONS",)


@contextmanager
def megatron_patches(cpu: bool) -> Iterator[None]:
    """Apply :func:`patch_targets` inside the block only; on leaving (also on an exception) every
    patched attribute is its original object again. Nested blocks restore what they found.
    Megatron's notices that do not apply here (:data:`_NOTICES`) are not printed inside it."""
    with warnings.catch_warnings():
        for text in _NOTICES + (_CPU_NOTICES if cpu else ()):
            warnings.filterwarnings("ignore", message=text)
        targets = patch_targets(cpu)
        saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in targets]
        try:
            for owner, name, value in targets:
                setattr(owner, name, value)
            yield
        finally:
            for owner, name, old in reversed(saved):
                if old is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)


# ---------------------------------------------------------------------------------------- config
_RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},  # selective = core_attn
              "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def megatron_config(shape: BenchShape, tp_size: int, recompute: Recompute, sequence_parallel: bool):
    """The ``TransformerConfig`` of seqpar's GPT: GeLU, biases, LayerNorm eps 1e-5, ``shape.dropout``,
    fused kernels off (CUDA-only), no initialisation (weights are loaded afterwards)."""
    from megatron.core.transformer import TransformerConfig

    dtype = _DTYPES[shape.dtype]
    with warnings.catch_warnings():  # its advice on TransformerEngine's fused attention does not apply
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        return TransformerConfig(
            num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            ffn_hidden_size=shape.ffn_hidden, tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel,
            hidden_dropout=shape.dropout, attention_dropout=shape.dropout, add_bias_linear=True, activation_func=F.gelu,
            normalization="LayerNorm", layernorm_epsilon=1e-5, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=True, perform_initialization=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, apply_query_key_layer_scaling=False, **_RECOMPUTE[recompute])


# ---------------------------------------------------------------------------------------- weights
def qkv_dense_to_megatron(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a dense ``[3h, ...]`` QKV tensor: seqpar's ``[q; k; v]`` (``[3, a, d]`` rows) ->
    Megatron's per-head interleaved ``[a, 3, d]`` rows (head 0's q, k, v, then head 1's ...)."""
    return interleave(w, 3, heads)


def megatron_local_state(dense: dict[str, torch.Tensor], shape: BenchShape, tp_rank: int,
                         tp_size: int) -> dict[str, torch.Tensor]:
    """seqpar dense names -> this rank's Megatron ``GPTModel`` parameters. Column-parallel layers
    (QKV, fc1, the vocab-parallel embedding) hold contiguous row blocks of their own layout,
    row-parallel ones (proj, fc2) contiguous column blocks; norms, positions and the
    row-parallel biases are full copies. The output layer is tied to the word embedding."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] // tp_size
        return x[tp_rank * n:(tp_rank + 1) * n]

    def cols(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1] // tp_size
        return x[:, tp_rank * n:(tp_rank + 1) * n]

    out = {"embedding.word_embeddings.weight": rows(dense["wte.weight"]),
           "embedding.position_embeddings.weight": dense["wpe.weight"],
           "decoder.final_layernorm.weight": dense["ln_f.weight"],
           "decoder.final_layernorm.bias": dense["ln_f.bias"]}
    for i in range(shape.layers):
        src, dst = f"blocks.{i}.", f"decoder.layers.{i}."
        for p in ("weight", "bias"):
            out[dst + f"input_layernorm.{p}"] = dense[src + f"ln1.{p}"]
            out[dst + f"pre_mlp_layernorm.{p}"] = dense[src + f"ln2.{p}"]
            out[dst + f"self_attention.linear_qkv.{p}"] = rows(qkv_dense_to_megatron(dense[src + f"attn.qkv.{p}"],
                                                                                   shape.heads))
            out[dst + f"mlp.linear_fc1.{p}"] = rows(dense[src + f"mlp.fc1.{p}"])
        out[dst + "self_attention.linear_proj.weight"] = cols(dense[src + "attn.proj.weight"])
        out[dst + "self_attention.linear_proj.bias"] = dense[src + "attn.proj.bias"]
        out[dst + "mlp.linear_fc2.weight"] = cols(dense[src + "mlp.fc2.weight"])
        out[dst + "mlp.linear_fc2.bias"] = dense[src + "mlp.fc2.bias"]
    return out


# ---------------------------------------------------------------------------------------- the peer
class MegatronPeer:
    """Megatron-core ``GPTModel`` (local spec, learned positions, tied embeddings, GeLU, biases,
    fp32, dropout 0) with AdamW over this rank's parameters. Megatron's own parallel state is
    initialised on the default process group with TP groups of consecutive ranks, which must be
    the ranks of the ``tp_group`` passed to :meth:`build`."""

    name = "megatron-core"

    def __init__(self) -> None:
        self.model = None
        self.optimizer = None
        self.cpu = True  # run on CPU gloo, under the CPU patches (set by build)

    def build(self, shape: BenchShape, dense_state: dict[str, torch.Tensor], *, tp_group, tp_rank: int,
              tp_size: int, recompute: Recompute, sequence_parallel: bool = True) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        if shape.dtype not in _DTYPES:
            raise ValueError(f"MegatronPeer: dtype must be one of {tuple(_DTYPES)}, got {shape.dtype!r}")
        self.cpu = not (torch.cuda.is_available() and backend_of(world_group()) == "nccl")
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", torch.cuda.current_device())
        with megatron_patches(self.cpu):
            self._build(shape, dense_state, tp_group, tp_rank, tp_size, recompute, sequence_parallel)

    def _build(self, shape: BenchShape, dense_state: dict[str, torch.Tensor], tp_group, tp_rank: int,
               tp_size: int, recompute: Recompute, sequence_parallel: bool) -> None:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        self.group = self._init_parallel_state(parallel_state, tp_group, tp_size)
        model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank)
        config = megatron_config(shape, tp_size, recompute, sequence_parallel and tp_size > 1)
        model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shape.vocab_size,
                         max_sequence_length=shape.seq_len, position_embedding_type="learned_absolute",
                         share_embeddings_and_output_weights=True, parallel_output=True)
        self._load(model, megatron_local_state(dense_state, shape, tp_rank, tp_size))
        self.model = model.to(self.device).train()
        self.shape = shape
        self.sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        self._mask: torch.Tensor | None = None

    @staticmethod
    def _init_parallel_state(parallel_state, tp_group, tp_size: int):
        """(Re)initialise Megatron's groups for ``tp_size``; return its TP group after checking it
        spans the same ranks as ``tp_group``."""
        if parallel_state.model_parallel_is_initialized() and \
                parallel_state.get_tensor_model_parallel_world_size() != tp_size:
            parallel_state.destroy_model_parallel()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                     create_gloo_process_groups=False)
        group = parallel_state.get_tensor_model_parallel_group()
        want = group_ranks(tp_group)
        have = group_ranks(group)
        if sorted(want) != sorted(have):
            raise ValueError(f"MegatronPeer: Megatron's TP group is ranks {have} but tp_group is ranks {want}; "
                             "Megatron groups consecutive ranks")
        return group

    @staticmethod
    def _load(model: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
        copy_into(dict(model.named_parameters()), local, "MegatronPeer: weight mapping")

    # ------------------------------------------------------------------------------------ steps
    def _loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        if self._mask is None or self._mask.shape[-1] != s:
            # True = masked out; passed explicitly (Megatron's default causal mask is built on "cuda")
            self._mask = torch.ones(s, s, dtype=torch.bool, device=self.device).triu_(1).view(1, 1, s, s)
        tokens, labels = tokens.to(self.device), labels.to(self.device)
        positions = torch.arange(s, device=self.device).expand(b, s)
        keep = labels != -100
        per_token = self.model(tokens, positions, self._mask, labels=labels.masked_fill(~keep, 0))  # [b, s]
        return (per_token * keep).sum() / keep.sum()

    def _allreduce_sp_grads(self) -> None:
        """Sum the gradients of the ``sequence_parallel``-tagged weights (norms, row-parallel
        biases) over TP: each rank saw only its ``s/t`` rows. One coalesced all-reduce."""
        all_reduce_coalesced([p.grad for p in self.sp_params if p.grad is not None], self.group)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        with megatron_patches(self.cpu):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._loss(tokens, labels)
            loss.backward()
            self._allreduce_sp_grads()
            self.optimizer.step()
        return float(loss.detach())

    def saved_bytes_per_layer(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean bytes per ``decoder.layers.*`` kept for backward by one forward. Megatron's own
        causal mask (``[1, 1, s, s]`` bool, saved by the masked fill) is one storage shared by all
        layers: it is charged to the first layer that saves it."""
        with megatron_patches(self.cpu), ActivationLedger(self.model, layer_pattern=LAYER_PATTERN) as ledger:
            loss = self._loss(tokens, labels)
        del loss  # frees the graph: nothing is kept past this call
        per_layer = ledger.per_layer()
        if not per_layer:
            raise RuntimeError("MegatronPeer: the ledger attributed no saved tensors to decoder.layers.*")
        return sum(per_layer.values()) / self.shape.layers

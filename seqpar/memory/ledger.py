"""Measure the activation bytes a forward pass keeps for backward, attributed to modules.

``ActivationLedger`` runs under ``torch.autograd.graph.saved_tensors_hooks``: every tensor
autograd saves is recorded once per storage (views of one buffer count once), parameters and
buffers are excluded, and each storage is charged to the innermost module running when it was
first saved. A tensor saved outside any layer that is a layer's input (what full recomputation
keeps) is charged to that layer.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from ..recompute import is_compiled_block  # hooks inside a compiled block would be traced into its graph
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef

# module-name suffix -> the paper's name for what that module keeps (PAPER.md, Table 2 notes)
TERMS = {
    "ln1": "LayerNorm input", "ln2": "LayerNorm input", "ln_f": "final LayerNorm input",
    "attn.qkv": "QKV input", "attn": "Q, K, V (kept for selective recompute)",
    "attn.core": "attention core", "attn.proj": "projection input",
    "attn_dropout": "post-attention dropout mask", "mlp.fc1": "fc1 input", "mlp.act": "GeLU input",
    "mlp.fc2": "fc2 input", "mlp_dropout": "post-MLP dropout mask", "": "layer input (full recompute)",
    "wte": "embedding", "drop": "embedding dropout mask",
}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor has no storage of its own: count its local shard."""
    return getattr(t, "_local_tensor", t)


def storage_key(t: torch.Tensor) -> int:
    """What identifies ``t``'s storage: its address, or for a fake tensor (no data, address 0;
    ``seqpar train --dry-run``) the storage object itself."""
    storage = t.untyped_storage()
    return storage._cdata if is_fake(t) else storage.data_ptr()


def _refine(term: str, role: str, t: torch.Tensor) -> str:
    """Name the individual tensors inside modules that keep several."""
    if role in ("ln1", "ln2", "ln_f") and t.dim() and t.shape[-1] == 1:
        return "LayerNorm mean/rstd (small, left out by the paper)"
    if role == "attn.core":
        if t.dtype == torch.bool:
            return "softmax dropout mask"
        if t.dim() >= 3 and t.shape[-1] == t.shape[-2]:
            return "softmax output / softmax-dropout output"
        return "Q, K, V"
    return term


def _is_generator_state(t: torch.Tensor) -> bool:
    """A dropout generator state (1-D uint8: 5,056 bytes on the CPU, 16 on CUDA) that a compiled
    block keeps to replay a recomputed dropout; the eager checkpoint keeps the same states outside
    autograd. Bookkeeping of the recomputation, not an activation: left out of the ledger."""
    return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() in (torch.get_rng_state().numel(), 16)


@dataclass
class SavedTensor:
    module: str          # qualified module name ("" = the root)
    layer: str | None    # "blocks.3" for tensors a transformer layer keeps, else None
    term: str            # what it is, in the paper's words where known
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int          # bytes of the whole underlying storage


class ActivationLedger:
    """Context manager recording what ``model``'s forward keeps for backward.

    >>> with ActivationLedger(model) as ledger:
    ...     loss = model(tokens, labels)
    >>> ledger.per_layer()        # {"blocks.0": bytes, ...}
    """

    def __init__(self, model: nn.Module, layer_pattern: str = r"blocks\.\d+", exclude: Iterable[torch.Tensor] = ()):
        """``layer_pattern``: regex matching the qualified names of the transformer layers
        (seqpar's GPT: ``blocks.3``; other systems name them differently). ``exclude``: more
        weight tensors that are not activations (e.g. the bf16 compute copies of the parameters)."""
        self.model = model
        self._exclude = list(exclude)
        self._layer_re = re.compile(rf"^(.*?{layer_pattern})(?:\.(.*))?$")
        self.records: list[SavedTensor] = []
        self._stack: list[str] = []
        self._seen: set[int] = set()
        self._layer_inputs: dict[int, tuple[str, StorageWeakRef]] = {}  # storage -> the layer it entered
        self._handles: list = []

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        return storage_key(_local(t))

    def _weights(self) -> set[int]:
        """Storages of the parameters, buffers and ``exclude`` tensors the model holds now (read from
        the modules' own tables: a swap of compute copies or FSDP2's gathered ones is seen)."""
        held = (t for m in self._holders for table in (m._parameters, m._buffers) for t in table.values())
        return {self._ptr(w) for w in (*held, *self._exclude) if w is not None}

    def __enter__(self) -> "ActivationLedger":
        self._holders = [m for m in self.model.modules() if m._parameters or m._buffers]
        self._skip = self._weights()
        self._modules = dict(self.model.named_modules())
        compiled = [name + "." for name, m in self._modules.items() if is_compiled_block(m)]
        for name, module in self.model.named_modules():
            if any(name.startswith(prefix) for prefix in compiled):
                continue  # inside a compiled block: one graph, charged to the block
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(), always_call=True))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name):
        def hook(module, args, kwargs):
            self._stack.append(name)
            # FSDP2 swaps gathered copies in before a unit's forward and frees them after it: the
            # weights are those held now, or an activation reusing a freed copy's address would
            # be taken for a weight
            self._skip = self._weights()
            m = self._layer_re.match(name)
            if m and m.group(2) is None:  # a transformer layer itself: remember its input
                first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
                if first is not None:
                    key = self._ptr(first)
                    if self.layer_input(key) is None:
                        self._layer_inputs[key] = (name, StorageWeakRef(_local(first).untyped_storage()))
        return hook

    def layer_input(self, key: int) -> str | None:
        """The layer whose input lives in storage ``key``, if that storage is still alive (a freed
        storage's address, or a fake one's, is soon another tensor's)."""
        entry = self._layer_inputs.get(key)
        if entry is None or entry[1].expired():
            return None
        return entry[0]

    def _post(self):
        def hook(module, args, output):
            self._stack.pop()
        return hook

    def _pack(self, saved: torch.Tensor) -> torch.Tensor:
        t = _local(saved)
        ptr = self._ptr(t)
        if ptr in self._skip or ptr in self._seen or t.untyped_storage().nbytes() == 0 or _is_generator_state(t):
            return saved
        self._seen.add(ptr)
        module = self._stack[-1] if self._stack else ""
        m = self._layer_re.match(module)
        if m:
            layer, role = m.group(1), m.group(2) or ""
        elif self.layer_input(ptr) is not None:  # saved outside the layers: full recompute's kept input
            layer, role = self.layer_input(ptr), ""
        else:
            layer, role = None, module
        term = _refine(TERMS.get(role, role or "other"), role, t)
        if not role and module and is_compiled_block(self._modules.get(module)):
            term = "kept by the compiled block"
        self.records.append(SavedTensor(module, layer, term, tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return saved

    # ------------------------------------------------------------------ summaries
    def total(self) -> int:
        return sum(r.nbytes for r in self.records)

    def per_layer(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if r.layer is not None:
                out[r.layer] += r.nbytes
        return dict(out)

    def outside_layers(self) -> int:
        return sum(r.nbytes for r in self.records if r.layer is None)

    def by_term(self, layer: str | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if layer is None or r.layer == layer:
                out[r.term] += r.nbytes
        return dict(out)

    def table(self, layer: str | None = None) -> str:
        """A Markdown table of one layer's saved tensors (default: the first layer)."""
        layer = layer or next(iter(self.per_layer()), None)
        rows = [r for r in self.records if r.layer == layer]
        lines = [f"saved for backward by {layer}:", "| module | term | shape | dtype | bytes |", "|---|---|---|---|---|"]
        lines += [f"| {r.module or '(root)'} | {r.term} | {list(r.shape)} | {str(r.dtype).replace('torch.', '')} | "
                  f"{r.nbytes:,} |" for r in rows]
        lines.append(f"| **total** | | | | **{sum(r.nbytes for r in rows):,}** |")
        return "\n".join(lines)

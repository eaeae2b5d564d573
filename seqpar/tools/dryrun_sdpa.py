"""The attention kernel a dry run's fake tensors run: the one the target device would run.

A dry run's tensors are fake CPU tensors, and left alone ``scaled_dot_product_attention`` on them
runs a kernel no GPU would: ``torch._fused_sdp_choice`` of a fake tensor answers the math kernel
(its fake implementation knows no device's rules), :func:`~seqpar.recompute.replayable_sdpa` pins
that answer, and the step keeps the math kernel's fp32 ``[b, a, s, s]`` scores where a GPU's flash
kernel keeps an O(s) log-sum-exp (llama3-8b at t=1: 299 GiB of activations measured against the
planner's 34 GiB). Answered right, CPU tensors would still run the CPU's kernels.

:class:`TargetAttention`, a ``TorchFunctionMode`` around the step, answers both for the target:

* ``torch._fused_sdp_choice``: on ``cuda`` :func:`~seqpar.memory.whole_model.cuda_sdpa_kernel`,
  the checks of PyTorch's CUDA kernels in its order of preference less what an enclosing
  ``sdpa_kernel`` disables (the rule the planner's formulas use); on ``cpu`` PyTorch's own answer
  for real one-token tensors of the same heads, head dim and dtype (its CPU checks read no more).
* ``F.scaled_dot_product_attention`` on ``cuda``: the chosen CUDA kernel's own operator
  (``aten._scaled_dot_product_flash_attention``, ``..._efficient_attention``,
  ``..._cudnn_attention``), whose fake implementation returns, and whose autograd node keeps,
  what the GPU's does: q, k, v, the output, the fp32 log-sum-exp, the RNG seed and offset. The math
  fallback is PyTorch's composite math operator, given a 1-byte dropout mask as CUDA's fused
  dropout keeps one. On ``cpu`` the call runs as it is: the CPU's kernels are this host's.

Nothing in the model knows of it; a call with an explicit ``attn_mask`` runs as it is.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from ..memory.whole_model import CUDA_SDPA_ORDER, cuda_sdpa_kernel

_BACKEND = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH, "none": SDPBackend.ERROR}
_NAME = {int(v): k for k, v in _BACKEND.items()}
_ENABLED = {"flash": torch.backends.cuda.flash_sdp_enabled, "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}


def enabled_order() -> list[str]:
    """CUDA's kernels in PyTorch's order of preference, less those disabled now (``sdpa_kernel``)."""
    priority = getattr(torch._C, "_get_sdp_priority_order", None)
    names = [_NAME[i] for i in priority() if i in _NAME] if priority else list(CUDA_SDPA_ORDER)
    return [n for n in names if n in _ENABLED and _ENABLED[n]()]


def cuda_kernel(query: torch.Tensor, key: torch.Tensor) -> str:
    """The kernel CUDA runs for ``[b, heads, s, d]`` ``query`` and ``key`` (:func:`cuda_sdpa_kernel`)."""
    return cuda_sdpa_kernel(dtype_bytes=query.element_size(), heads=query.shape[-3], kv_heads=key.shape[-3],
                            head_dim=query.shape[-1], order=enabled_order())


def cpu_choice(query, key, value, dropout_p: float, is_causal: bool, enable_gqa: bool) -> int:
    """PyTorch's CPU answer for real ``[1, heads, 1, d]`` tensors like ``query``, ``key``, ``value``."""
    with unset_fake_temporarily():
        probe = [torch.empty((1, x.shape[-3], 1, x.shape[-1]), dtype=x.dtype).requires_grad_(x.requires_grad)
                 for x in (query, key, value)]
        return torch._fused_sdp_choice(*probe, None, dropout_p, is_causal, enable_gqa=enable_gqa)


def cuda_attention(query, key, value, dropout_p: float, is_causal: bool, scale: float | None,
                   enable_gqa: bool) -> torch.Tensor:
    """``[b, a, s, d]`` attention through the operator of the CUDA kernel :func:`cuda_kernel` picks."""
    ops, kind = torch.ops.aten, cuda_kernel(query, key)
    if kind == "flash":
        return ops._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if kind == "efficient":
        return ops._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p, is_causal,
                                                           scale=scale)[0]
    if kind == "cudnn":
        return ops._scaled_dot_product_cudnn_attention(query, key, value, None, True, dropout_p, is_causal, False,
                                                       scale=scale)[0]
    if kind == "math":
        mask = None
        if dropout_p > 0:  # CUDA's fused dropout keeps a 1-byte mask (the CPU's, one of the scores' dtype)
            b, a, s = query.shape[:3]
            mask = torch.empty((b, a, s, key.shape[-2]), dtype=torch.bool, device=query.device)
        return ops._scaled_dot_product_attention_math(query, key, value, None, dropout_p, is_causal, mask,
                                                      scale=scale, enable_gqa=enable_gqa)[0]
    raise RuntimeError(f"no CUDA attention kernel is enabled for these inputs (enabled: {enabled_order()})")


class TargetAttention(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as ``device`` ("cuda" / "cpu") would (module docstring)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self._warnings = warnings.catch_warnings()

    def __enter__(self):
        self._warnings.__enter__()  # the math operator given a mask warns it is for testing; here it stands in
        warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._warnings.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._fused_sdp_choice:
            return self.choice(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self.device == "cuda":
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def choice(self, query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, *,
               scale: float | None = None, enable_gqa: bool = False) -> int:
        if attn_mask is not None:
            return torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
        if self.device == "cuda":
            return int(_BACKEND[cuda_kernel(query, key)])
        return cpu_choice(query, key, value, dropout_p, is_causal, enable_gqa)

    def attention(self, query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None:
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
        return cuda_attention(query, key, value, dropout_p, is_causal, scale, enable_gqa)


__all__ = ["TargetAttention", "cpu_choice", "cuda_attention", "cuda_kernel", "enabled_order"]

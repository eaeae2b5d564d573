"""Fused attention (``model.attention: sdpa``) with attention dropout, exact under recompute and
compile (issue 33 item 1): its mask comes from seqpar's per-rank stream, eager through the swapped
generator state, compiled through ``seqpar::stream_sdpa`` (one op that takes the state and returns
the next), so every recompute mode and the compiled step replay the eager masks bit for bit.
Before the fix ``compile_blocks`` refused sdpa with attention dropout. Measured on CPU only (the
CUDA kernels take the same path; no GPU here)."""
import torch
from torch.nn.attention import SDPBackend

from compile_helpers import Recorder, graph_breaks
from gpt_helpers import batch, tiny_config
from seqpar.model import GPT
from seqpar.parallel.compile import compile_blocks

SDPA = dict(attention="sdpa", dropout=0.1, attention_dropout=0.3, sequence_parallel=False, layers=2)


def _steps(cfg, mode: str, compiled: bool, steps: int = 2):
    """Losses and gradients of ``steps`` steps (the streams advance between them), the stream states
    after, and the ops of the recorded forward graphs (compiled only)."""
    model = GPT(tiny_config(**cfg, recompute=mode), seed=3)
    rec = Recorder()
    if compiled:
        compile_blocks(model, backend=rec.backend)
    tokens, labels = batch(model.config)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    ops = {str(n.target) for kind, gm in rec.graphs if kind == "forward" for n in gm.graph.nodes}
    return out, {k: v.clone() for k, v in model.rng.states.items()}, ops


def _identical(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and x[1].keys() == y[1].keys() and
               all(torch.equal(x[1][n], y[1][n]) for n in x[1]) for x, y in zip(a, b))


def test_fused_attention_dropout_replays_bit_identically_in_every_recompute_mode_eager_and_compiled():
    before = graph_breaks()
    (base, base_states, _), runs = _steps(SDPA, "none", False), {}
    for compiled in (False, True):
        for mode in ("none", "selective", "full"):
            if (compiled, mode) != (False, "none"):
                runs[(compiled, mode)] = _steps(SDPA, mode, compiled)
    assert graph_breaks() == before
    for key, (steps, states, ops) in runs.items():
        assert _identical(steps, base), key
        assert all(torch.equal(states[k], base_states[k]) for k in base_states), key  # streams advanced alike
        assert not key[0] or "seqpar.stream_sdpa.default" in ops, (key, sorted(ops))
    # the dropout is real: another seed draws other masks
    other = GPT(tiny_config(**SDPA), seed=4)
    other.load_state_dict(GPT(tiny_config(**SDPA), seed=3).state_dict())
    assert not torch.equal(other(*batch(other.config)).detach(), base[0][0])


def test_compiled_grouped_query_sdpa_with_dropout_equals_eager():
    llama = dict(SDPA, norm="rmsnorm", position="rope", mlp="swiglu", kv_heads=2, bias=False, ffn_hidden=48)
    eager, eager_states, _ = _steps(llama, "none", False, steps=1)
    compiled, states, ops = _steps(llama, "selective", True, steps=1)
    assert "seqpar.stream_sdpa.default" in ops
    assert _identical(compiled, eager) and all(torch.equal(states[k], eager_states[k]) for k in states)


def test_compile_true_accepted_with_sdpa_and_attention_dropout():
    from seqpar.config import load_run_config
    from seqpar.parallel.compile import compile_enabled
    from seqpar.recompute import compile_unsupported
    cfg = load_run_config("tiny-cpu", ["train.compile=true", "model.attention=sdpa", "model.attention_dropout=0.1"])
    assert cfg.train.compile is True and compile_unsupported(cfg.model) is None
    assert compile_enabled("auto", torch.device("cuda"), cfg.model) is True  # auto no longer runs it eagerly


def _grad_dependent_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    """A GPU whose SDPA choice depends on grad (sm86/89, head_dim > 192): flash without, math with."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return int(SDPBackend.MATH if grad else SDPBackend.FLASH_ATTENTION)


def test_the_compiled_ops_detached_inputs_choose_the_eager_steps_kernel(monkeypatch):
    """A compiled graph hands the op detached inputs; before the fix the kernel was chosen for them
    (flash here) while the eager step's inputs need grad (math): another kernel, another mask."""
    from seqpar.recompute import sdpa_backend
    monkeypatch.setattr(torch, "_fused_sdp_choice", _grad_dependent_choice)
    q = torch.randn(1, 2, 4, 8)
    assert sdpa_backend(q, q, q, 0.1, True) == SDPBackend.MATH
    assert sdpa_backend(q.requires_grad_(), q, q, 0.1, True) == SDPBackend.MATH

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

# Import names of the packages in pyproject's `test` extra (tests/test_ci_extras.py keeps the two in
# step). Under CI=true a test that `pytest.importorskip`s one of them fails instead of skipping.
TEST_EXTRA_MODULES = ("hypothesis", "transformers", "megatron.core", "matplotlib", "datasets")


def pytest_addoption(parser):
    """Options of the GPU checks (tests/gpu/conftest.py reads them); here so that every run knows them."""
    group = parser.getgroup("seqpar GPU checks (tests/gpu)")
    group.addoption("--gpu-table", metavar="PATH", default=None,
                    help="print the GPU checks' rows as a table at the end and write them to PATH (.json: JSON, "
                         "else Markdown; -: print only)")
    group.addoption("--gpu-tp", metavar="N", type=int, default=None,
                    help="t of the multi-GPU correctness check (default: the largest power of two <= the GPU "
                         "count, at most 16)")


def _fail_if_test_extra_missing(report) -> None:
    if not report.skipped or os.environ.get("CI", "").lower() not in ("true", "1"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(f"could not import '{name}'" in reason for name in TEST_EXTRA_MODULES):
        report.outcome = "failed"
        report.longrepr = f"{reason}\nCI=true: the `test` extra must be installed (pip install -e .[test])"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_test_extra_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_test_extra_missing(outcome.get_result())


# ranks fork from a server that imported these once (seqpar.distributed.local); the Hugging Face
# tests' ranks import transformers and its GPT-2 and Llama models, and the compile tests' ranks
# dynamo, AOTAutograd and Inductor (about a second each, paid once here instead of in every
# rank; a module that is not installed is skipped). Importing them starts no torch thread pool.
from seqpar.distributed import local as _local  # noqa: E402

_local.PRELOAD += ["transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                   "torch._dynamo", "torch._inductor.compile_fx", "functorch.compile"]


@pytest.fixture
def spawn(tmp_path):
    """``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks
    (:func:`seqpar.distributed.local.run_local`) and returns each rank's result in rank order."""
    from distributed_harness import run_ranks

    def _spawn(fn, world_size, *args):
        return run_ranks(fn, world_size, tmp_path, *args)

    return _spawn

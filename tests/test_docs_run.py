"""Every command and Python snippet of README.md and docs/*.md runs as written.

The commands come from the pages' fenced ``bash`` and ``python`` blocks, so a new page or line is
covered without touching this file. Each runs in one scratch folder, in page order (README first),
so a later line finds what an earlier one wrote (``runs/tiny-cpu/checkpoints``). The test adds only
what keeps it cheap: ``train.steps`` of 2 more than the checkpoint already holds, a small data
budget, a 4-token end-of-run sample. ``seqpar`` commands run through the command line's own entry;
``--nproc-per-node N`` runs the rank's program on N local ranks (the launcher itself:
tests/test_local_launcher.py). A line that cannot run here is listed in NOT_RUN with its reason,
and a listed line no page has any more fails the test, so nothing is skipped silently.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import time
from pathlib import Path

import pytest

from test_docs import PAGES, ROOT, shell_commands, split_markdown

transformers = pytest.importorskip("transformers")

# (regular expression matched at the start of a command line, why it does not run here)
NOT_RUN = [
    (r"pip install", "installs packages (the test runs in the installed checkout)"),
    (r"python3? -m pytest", "runs the test suite itself"),
    (r"bash scripts/gpu_check\.sh", "the GPU check script (its CPU smoke: tests/gpu, tests/test_gpu_paths.py)"),
    (r"python -c .import torch; print\(torch\.cuda", "reports CUDA devices: GPU machines only"),
    (r"torchrun --standalone --nproc-per-node 8 -m seqpar\.train gpt-1\.3b", "8 GPUs"),
    (r"torchrun --nnodes", "a multi-node cluster job"),
    (r"seqpar train .*--dry-run", "a 64-1,024 GPU job's rank built on fake tensors takes minutes on 2 cores; "
                                  "tests/test_dry_run*.py run the same path on small worlds"),
    (r"seqpar plan .*--verify", "dry-runs a 64 GPU layout (minutes); tests/test_plan_verify.py"),
    (r"python scripts/dry_run_paper\.py", "four paper-size dry runs (minutes); tests/test_dry_run.py"),
    (r"seqpar bench|python scripts/bench|python scripts/bench_layers\.py",
     "a benchmark prints timings of minutes (docs/benchmarks.md); tests/test_bench_cli.py and "
     "tests/test_side_by_side.py run them tiny"),
    (r"torchrun --nproc-per-node 2 (examples|scripts)/",
     "tests/test_dropin_examples.py runs the examples and the demo at t=2 as shipped"),
    (r"seqpar train CONFIG\.yaml|torchrun --nproc-per-node N", "the usage line, placeholders in capitals"),
    (r"seqpar plan CONFIG\.yaml", "a custom GPU's numbers for the reader's own config (placeholder)"),
    (r"seqpar (import|train) (HF_DIR|runs/llama/ckpt/step_00000000/config\.yaml data\.source=MY_TEXTS)",
     "placeholders; docs/models.md's block runs the same import, train, generate and export"),
    (r"seqpar train tiny-cpu data\.source=MEGATRON_PREFIX", "a Megatron dataset of the reader's (placeholder); "
                                                              "tests/test_data_shards.py reads one"),
    (r"seqpar train llama3-8b model\.seq_len=131072", "an 8B model at 128k tokens on 64 GPUs"),
    (r"seqpar memory configs/memory-demo-pp\.yaml --measure", "four pipeline ranks measured (40 s here); "
                                                            "the path of memory-demo.yaml --measure, which runs"),
    (r"seqpar memory llama3-70b", "prints a 70B model's formulas only; tests/test_memory_report.py"),
    (r"seqpar verify", "trains every layout on local ranks (30 s and more); tests/test_verify.py runs these"),
    (r"seqpar plan .*--png", "draws a figure with matplotlib (the same search as the line before)"),
    (r"seqpar memory --paper --png", "draws the paper's figure with matplotlib; tests/test_memory_report.py"),
]
# Python blocks that are excerpts of a file (every line of the block is in it); the file runs
EXCERPTS = ("examples/dropin_gpt2.py", "examples/dropin_llama.py", "examples/dropin_custom_block.py")
# Python blocks that are sketches over names the page defines in prose (a model, a mesh): (first line, why)
SKETCHES = [
    ("import seqpar\nfrom seqpar.dropin import Plan, Style", "a plan for the reader's own module"),
    ("from seqpar.dropin import set_sequence_parallel", "the generate step of examples/dropin_llama.py"),
    ("from seqpar.verify import assert_layouts_equal, verify", "the Python entry points over names the page "
     "defines in prose; tests/test_verify.py calls both"),
    ("# test_my_model.py", "tests/test_verify.py runs this pytest file as written"),
    ("from seqpar.interop.gpt2 import from_hf, to_hf", "tests/test_interop_gpt2.py runs the round trip"),
]
TRAIN_EXTRA = ["train.log_interval=1", "train.eval_interval=2", "train.eval_batches=1", "checkpoint.interval=2",
               "train.sample_tokens=4", "data.max_bytes=100000"]


def doc_commands() -> list[tuple[str, str]]:
    """(page name, command line) of every bash block, in page order, each line once."""
    seen, out = set(), []
    first = [ROOT / "README.md", ROOT / "docs" / "training.md", ROOT / "docs" / "models.md"]  # they make runs/
    for page in first + [p for p in PAGES if p not in first]:
        for tokens in shell_commands(page.read_text()):
            line = shlex.join(tokens) if any(" " in t for t in tokens) else " ".join(tokens)
            if line not in seen:
                seen.add(line)
                out.append((page.name, line))
    return out


def not_run_reason(line: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.match(pattern, line)), None)


def python_blocks() -> list[tuple[str, str]]:
    return [(page.name, "\n".join(lines)) for page in PAGES
            for lang, lines in split_markdown(page.read_text())[1] if lang in ("python", "py")]


def excerpt_source(block: str) -> str | None:
    """The file a snippet is an excerpt of (all its code lines are in it), else None."""
    lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    for name in EXCERPTS:
        text = (ROOT / name).read_text()
        if all(ln in text or ln.split("#")[0].strip() in text for ln in lines):
            return name
    return next((f"sketch: {why}" for first, why in SKETCHES if block.startswith(first)), None)


# ------------------------------------------------------------------------------------- fixtures
def _tiny_hf_folders(root: Path) -> None:
    """./Llama-3.2-1B (a tiny Llama with its tokenizer), my_hf_model/ (a tokenizer), my_texts/,
    tokens.bin: the inputs the pages name as the reader's own."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "def", "x", "(", ")", ":", "return", "import", "os", "Once", "upon", "a", "time"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=1))
    llama.save_pretrained(root / "Llama-3.2-1B")
    tok.save(str(root / "Llama-3.2-1B" / "tokenizer.json"))
    (root / "my_hf_model").mkdir()
    tok.save(str(root / "my_hf_model" / "tokenizer.json"))
    (root / "my_texts").mkdir()
    for i in range(3):
        (root / "my_texts" / f"{i}.txt").write_text("def x ( ) : return x\nimport os\n" * 400)
    np.random.default_rng(0).integers(0, 14, 20000).astype(np.uint16).tofile(root / "tokens.bin")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs-run")
    for name in ("configs", "examples", "scripts"):
        (root / name).symlink_to(ROOT / name)
    _tiny_hf_folders(root)
    return root


# -------------------------------------------------------------------------------------- running
def _rank_train(rank: int, world: int, cwd: str, argv: list[str]) -> int:
    """One rank of ``seqpar train ARGV`` under a launcher (its program, as torchrun runs it)."""
    from seqpar.config import load_run_config
    from seqpar.tools import train_cli
    from seqpar.train import launch
    from seqpar.train.trainer import train

    os.chdir(cwd)
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), RANK=str(rank))
    args = launch.parse(train_cli.parser(), argv)
    with contextlib.redirect_stdout(io.StringIO()):
        train(load_run_config(args.config, args.overrides))
    return 0


def _steps_done(cwd: Path, argv: list[str]) -> int:
    from seqpar.config import load_run_config
    from seqpar.tools import train_cli
    from seqpar.train import launch

    with contextlib.chdir(cwd):
        args = launch.parse(train_cli.parser(), argv)
        ckpt = cwd / load_run_config(args.config, args.overrides).checkpoint.dir
    steps = [int(p.name.split("_")[1]) for p in ckpt.glob("step_*")] if ckpt.is_dir() else []
    return max(steps, default=0)


def run_line(line: str, cwd: Path) -> str:
    """Run one documented line in ``cwd``; return what it printed (raises on failure)."""
    from seqpar import cli
    from seqpar.distributed.local import run_local

    tokens = shlex.split(line)
    out = io.StringIO()
    if tokens[0] == "python" and tokens[1] == "-c":
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out):
            exec(compile(tokens[2], "<docs>", "exec"), {})
        return out.getvalue()
    assert tokens[0] == "seqpar", f"no runner for {line!r}: run it here or list it in NOT_RUN"
    argv = tokens[1:]
    if argv[0] == "train":
        argv = argv[1:] + [f"train.steps={_steps_done(cwd, argv[1:]) + 2}", *TRAIN_EXTRA]
        world = 1
        if "--nproc-per-node" in argv:
            i = argv.index("--nproc-per-node")
            world = int(argv.pop(i + 1))
            argv.pop(i)
        run_local(_rank_train, world, str(cwd), argv, timeout=300)
        return ""
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(argv)
    assert code == 0, f"{line!r} exited {code}:\n{out.getvalue()[-3000:]}"
    return out.getvalue()


def test_every_line_is_run_or_listed_with_a_reason():
    lines = [line for _, line in doc_commands()]
    stale = [pattern for pattern, _ in NOT_RUN if not any(re.match(pattern, ln) for ln in lines)]
    assert stale == [], f"NOT_RUN lists lines no page has: {stale}"
    for page, block in python_blocks():
        runnable = "init_parallel(" in block
        where = f"{page}: a python block that neither runs nor is an excerpt:\n"
        assert runnable or excerpt_source(block), where + block


# lines that read nothing an earlier line wrote: a test of their own, so two workers share the pages
STANDALONE = re.compile(r"seqpar (plan|memory) ")


def _run_lines(lines: list[tuple[str, str]], cwd: Path) -> None:
    failed = []
    for page, line in lines:
        if not_run_reason(line) is None:
            try:
                t0 = time.monotonic()
                run_line(line, cwd)
                print(f"{time.monotonic() - t0:6.1f} s  {line}")
            except Exception as e:  # noqa: BLE001 - every failing line is the finding
                failed.append(f"{page}: {line}\n    {type(e).__name__}: {str(e)[-1500:]}")
    assert failed == [], "\n".join(failed)


def test_documented_commands_run_as_written(scratch):
    """Every line but the planner's and `seqpar memory`'s, in page order."""
    _run_lines([(page, line) for page, line in doc_commands() if not STANDALONE.match(line)], scratch)


def test_documented_plan_and_memory_commands_run_as_written(scratch):
    lines = [(page, line) for page, line in doc_commands() if STANDALONE.match(line)]
    assert len(lines) >= 10, lines
    _run_lines(lines, scratch)


def _rank_snippet(rank: int, world: int, code: str) -> int:
    exec(compile(code, "<docs snippet>", "exec"), {"__name__": "__docs__"})
    return 0


def test_python_snippets_that_start_ranks_run():
    from seqpar.distributed.local import run_local

    ran = 0
    for page, block in python_blocks():
        m = re.search(r"init_parallel\(tp=(\d+)", block)
        if m:
            run_local(_rank_snippet, int(m.group(1)), block, timeout=120)
            ran += 1
    assert ran >= 1

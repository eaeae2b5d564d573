"""README.md and docs/*.md run as written: relative links (and their anchors) resolve, every
``seqpar`` command line in a bash block names a real command with flags its ``--help`` lists and
configs and overrides that load, script flags exist, and every repository path mentioned exists.
The README stays a short front door that links every docs page."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|scripts|examples|docs|tests)/[\w./-]*)")
FLAG = re.compile(r"--[A-Za-z][\w-]*")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # CONFIG.yaml, TOKENS.bin: stand for the reader's own
OVERRIDE = re.compile(r"^[a-z_]+(\.[a-z_]+)*=")


# ------------------------------------------------------------------------------- markdown parsing
def split_markdown(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(prose lines, [(language, lines)] of the fenced code blocks)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
                blocks.append((line.strip()[3:].strip(), current))
            else:
                current = None
            continue
        (prose if current is None else current).append(line)
    return prose, blocks


def without_inline_code(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in split_markdown(text)[0]:
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    prose = split_markdown(text)[0]
    return [m.group(1) for line in prose for m in LINK.finditer(without_inline_code(line))]


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links that point at no file, or at a heading the target page does not have."""
    bad = []
    for target in links(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text):
                bad.append(f"{page.name}: link {target!r}: no heading with anchor #{anchor} in {page.name}")
            continue
        dest = (page.parent / path).resolve()
        if not dest.exists():
            bad.append(f"{page.name}: link {target!r}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{page.name}: link {target!r}: no heading with anchor #{anchor} in {dest.name}")
    return bad


def path_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """Every configs/, scripts/, examples/, docs/ or tests/ path the page mentions exists."""
    bad = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,")
        if not (root / path).exists():
            bad.append(f"{page.name}: mentions {path!r}, which does not exist")
    return sorted(set(bad))


# --------------------------------------------------------------------------------- command lines
def shell_commands(text: str) -> list[list[str]]:
    """Each simple command (tokens) of the bash blocks; continuation lines joined, comments,
    prompts and ``&&`` / ``;`` / ``|`` chains split off."""
    out = []
    for lang, lines in split_markdown(text)[1]:
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            tokens = shlex.split(line, comments=True)
            current: list[str] = []
            for tok in tokens + [";"]:
                if tok in ("&&", "||", ";", "|"):
                    if current:
                        out.append(current)
                    current = []
                else:
                    current.append(tok)
    return out


def inline_commands(text: str) -> list[list[str]]:
    """The inline code spans of the prose that are whole seqpar command lines (`seqpar memory --paper`)."""
    spans = [m.group(1) for line in split_markdown(text)[0] for m in re.finditer(r"`(seqpar [^`]+)`", line)]
    return [shlex.split(span) for span in spans]


def as_seqpar(tokens: list[str]) -> list[str] | None:
    """``seqpar CMD ...``, ``python -m seqpar.cli CMD ...`` and ``torchrun ... -m seqpar.train ...``
    as ``[CMD, args...]``; None for any other command."""
    if tokens[0] == "seqpar":
        return tokens[1:] or [""]
    if "-m" in tokens:
        i = tokens.index("-m")
        module = tokens[i + 1] if i + 1 < len(tokens) else ""
        if module == "seqpar.cli":
            return tokens[i + 2:] or [""]
        if module in ("seqpar.train", "seqpar.train.launch"):
            return ["train", *tokens[i + 2:]]
    return None


def _is_placeholder(arg: str) -> bool:
    return bool(PLACEHOLDER.match(Path(arg).stem)) or arg.startswith("runs/")


def config_problems(cmd: str, args: list[str]) -> list[str]:
    """Configs named by train / memory / plan resolve; the overrides of each (train, import: always) load."""
    from seqpar.config import load_run_config, resolve_config

    if cmd not in ("train", "memory", "plan", "import"):
        return []
    flags_with_values = {"--nproc-per-node", "--max-restarts", "--gpus", "--gpu", "--tp", "--dp", "--png",
                         "--data-parallel", "--precision", "--top", "--layout", "--space", "--peak-tflops",
                         "--hbm-gib", "--nvlink-gbps", "--ib-gbps", "--micro-batch", "--max-gib", "--config",
                         "--global-batch", "--gpus-per-node", "--dtype", "--cp", "--headroom"}
    positional, config_flag, skip = [], None, False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = "=" not in a and a in flags_with_values
            if a == "--config" and i + 1 < len(args):
                config_flag = args[i + 1]
            continue
        positional.append(a)
    overrides = [a for a in positional if OVERRIDE.match(a)]
    names = [a for a in positional if not OVERRIDE.match(a) and not a.startswith(("[", "..."))]
    if cmd == "import":
        names, config = [], config_flag
    else:
        names = names if cmd == "memory" else names[:1]
        config = names[0] if names else None
    bad = []
    for name in names:
        if _is_placeholder(name):
            continue
        try:
            resolve_config(name)
        except FileNotFoundError as e:
            bad.append(f"seqpar {cmd}: {e}")
    if cmd in ("train", "import") and not any(_is_placeholder(n) for n in names):
        if config is not None and _is_placeholder(config):
            return bad
        try:
            load_run_config(config, overrides)
        except Exception as e:  # noqa: BLE001 - the error is the finding
            bad.append(f"seqpar {cmd} {' '.join(args)}: {type(e).__name__}: {e}")
    if cmd in ("memory", "plan") and overrides:
        for name in (n for n in names if not _is_placeholder(n)):
            try:
                load_run_config(name, overrides)
            except Exception as e:  # noqa: BLE001 - the error is the finding
                bad.append(f"seqpar {cmd} {' '.join(args)}: {type(e).__name__}: {e}")
    return bad


def command_problems(text: str, helps: dict[str, str | None], check_configs: bool = True,
                     root: Path = ROOT) -> list[str]:
    """Unknown seqpar commands, flags a command's --help does not list, configs that do not load,
    and flags a script given to python / bash / torchrun does not define."""
    bad = []
    for tokens in shell_commands(text) + inline_commands(text):
        line = " ".join(tokens)
        sp = as_seqpar(tokens)
        if sp is not None:
            cmd, args = sp[0], sp[1:]
            help_text = helps.get(cmd)
            if help_text is None:
                bad.append(f"{line!r}: no seqpar command {cmd!r}")
                continue
            for flag in {f for a in args for f in FLAG.findall(a) if a.lstrip("[").startswith("--")}:
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                    bad.append(f"{line!r}: seqpar {cmd} --help lists no {flag}")
            if check_configs:
                bad += config_problems(cmd, args)
            continue
        scripts = [t for t in tokens if t.startswith("scripts/") or t.startswith("examples/")]
        if scripts and (root / scripts[0]).is_file():
            source = (root / scripts[0]).read_text()
            called = re.findall(r"scripts/[\w/]+\.py", source)
            source += "".join((root / c).read_text() for c in called if (root / c).is_file())
            after = tokens[tokens.index(scripts[0]) + 1:]
            for flag in {f for a in after if a.startswith("--") for f in FLAG.findall(a)}:
                if f'"{flag}"' not in source and f"'{flag}'" not in source and f" {flag} " not in source:
                    bad.append(f"{line!r}: {scripts[0]} defines no {flag}")
    return bad


def seqpar_help(cmd: str) -> str | None:
    """``seqpar CMD --help`` through the command line's own entry; None for an unknown command."""
    from seqpar import cli

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([cmd, "--help"])
        except SystemExit as e:
            code = e.code or 0
    return out.getvalue() if code == 0 else None


# ------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def helps() -> dict[str, str | None]:
    used = set()
    for page in PAGES:
        for tokens in shell_commands(page.read_text()) + inline_commands(page.read_text()):
            sp = as_seqpar(tokens)
            if sp is not None:
                used.add(sp[0])
    return {cmd: seqpar_help(cmd) for cmd in sorted(used)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    assert link_problems(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mentioned_paths_exist(page):
    assert path_problems(page, page.read_text()) == []


def test_command_lines_name_real_commands_flags_and_configs(helps):
    bad = [f"{page.name}: {p}" for page in PAGES for p in command_problems(page.read_text(), helps)]
    assert bad == [], "\n".join(bad)


def test_the_readme_is_a_front_door_linking_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    targets = {t.partition("#")[0] for t in links(text)}
    missing = [f"docs/{p.name}" for p in DOCS if f"docs/{p.name}" not in targets]
    assert missing == [], f"README links no {missing}"
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m pytest") and f"&& {ci}\n" in text  # .ci/run runs exactly the README's command
    assert sum(ln.startswith("Packages, lowest first:") for ln in text.splitlines()) == 1


SYNTHETIC = """# Title

## Good `heading`: here

See [here](#good-heading-here), [the readme](../README.md) and [gone](nowhere.md),
[bad anchor](#no-such-heading), `[not](a-link.md)` in code, and `configs/no-such.yaml`.

```bash
seqpar train tiny-cpu --nproc-per-node 2 parallel.tp=2
seqpar trian tiny-cpu
seqpar train tiny-cpu --no-such-flag 1 \\
    train.stepz=3   # a comment --ignored
seqpar memory no-such-config
python scripts/demo_sp_mlp.py --bogus
```

Inline, `seqpar memory --mesure` is checked too.
"""


def test_the_checks_find_what_is_wrong():
    page = ROOT / "docs" / "synthetic.md"
    helps = {"train": "usage: seqpar train [--nproc-per-node N] [--max-restarts K]",
             "memory": "usage: seqpar memory [--measure]"}
    assert slug("Training (`seqpar train`)") == "training-seqpar-train"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    assert link_problems(page, SYNTHETIC) == [
        f"synthetic.md: link 'nowhere.md': no file {ROOT / 'docs' / 'nowhere.md'}",
        "synthetic.md: link '#no-such-heading': no heading with anchor #no-such-heading in synthetic.md",
    ]
    assert path_problems(page, SYNTHETIC) == ["synthetic.md: mentions 'configs/no-such.yaml', which does not exist"]
    bad = command_problems(SYNTHETIC, helps)
    assert len(bad) == 6, bad
    assert "no seqpar command 'trian'" in bad[0]
    assert "--help lists no --no-such-flag" in bad[1] and "--ignored" not in " ".join(bad)
    assert "unknown key 'train.stepz'" in bad[2]
    assert "'no-such-config' is neither an existing file nor a shipped config" in bad[3]
    assert "scripts/demo_sp_mlp.py defines no --bogus" in bad[4]
    assert "seqpar memory --help lists no --mesure" in bad[5]
    clean = SYNTHETIC.split("```bash")[0].replace("[gone](nowhere.md),", "").replace("[bad anchor](#no-such-heading),", "")
    assert link_problems(page, clean) == [] and command_problems("```bash\nseqpar train tiny-cpu\n```", helps) == []


def test_the_layout_page_lists_every_module_and_only_real_ones():
    block = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    listed, package = set(), None
    for line in block.splitlines():
        first = line.split("  ")[0].strip() if not line.startswith(" ") else line.strip().split("  ")[0]
        if not line.startswith(" ") and first.endswith("/"):
            package = first
            continue
        names = [n.strip() for n in first.split(",")]
        listed |= {n if not line.startswith(" ") else package + n for n in names if n.endswith(".py")}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "seqpar").rglob("*.py")
               if p.name != "__init__.py" or p.parent.name == "seqpar"}
    assert not modules - listed, f"modules missing from docs/layout.md: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/layout.md lists modules that do not exist: {sorted(listed - modules)}"


def documented_keys(text: str) -> set[str]:
    """The config keys of a Markdown key table: the first cell's backticked names, each bare name
    (`` `seq_len` ``) in the section of the dotted one before it (`` `model.vocab_size` ``)."""
    keys, section = set(), ""
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([\w.]+)`", line.split("|")[1]):
            if "." in name:
                section, _, name = name.rpartition(".")
            elif name == "out_dir":
                section = ""
            keys.add(f"{section}.{name}" if section else name)
    return keys


def test_the_training_key_table_lists_every_config_key():
    from seqpar.config import RunConfig, to_dict

    schema = {f"{section}.{key}" if isinstance(value, dict) else section
              for section, value in to_dict(RunConfig()).items() for key in (value if isinstance(value, dict) else [0])}
    listed = documented_keys((ROOT / "docs" / "training.md").read_text())
    assert not schema - listed, f"keys missing from docs/training.md's table: {sorted(schema - listed)}"
    assert not listed - schema, f"docs/training.md's table names keys that do not exist: {sorted(listed - schema)}"


def test_train_help_has_examples_that_run_as_written():
    text = seqpar_help("train")
    examples = [ln.strip() for ln in text.split("examples:", 1)[-1].splitlines() if ln.startswith("  ")]
    assert any("parallel.cp=2" in e for e in examples) and any("data.tokenizer=" in e for e in examples), text
    assert "docs/training.md" in text and (ROOT / "docs" / "training.md").is_file()
    assert command_problems("```bash\n" + "\n".join(examples) + "\n```\n", {"train": text}) == []
    option = seqpar_help("generate").rsplit("--tokens TOKENS", 1)[1]  # the option's help, not the usage line
    assert ">= 1" in option.split("--", 1)[0]

"""A run's data: the corpus, this dp rank's training batches and eval batches, the tokenizer file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from ..config import RunConfig
from .batches import Batch, TokenBatches, eval_batches
from .blend import BlendBatches, Joined
from .corpus import Corpus, default_cache_dir, prepare_corpus
from .kinds import source_kind
from .errors import DataError, TokenizerError
from .tokenizer import ORIGIN_FILE, check_fits, checkpoint_tokenizer, find_eot, load_tokenizer, tokenizer_digest


def run_tokenizer(cfg: RunConfig, needs_eot: bool) -> tuple[Tokenizer | None, int | None, str | None]:
    """``(tokenizer, end-of-text id, where it came from)`` for the run's text sources:
    ``data.tokenizer``, else the given tokenizer of the checkpoint it resumes, else none (a BPE is
    trained). The tokenizer must fit ``model.vocab_size``; a missing end-of-text id is an error
    only when a text source needs one (``needs_eot``)."""
    dc = cfg.data
    spec, eot = dc.tokenizer, dc.eot_id
    where = f"data.tokenizer={spec!r}"
    if spec is None:
        spec, saved_eot = checkpoint_tokenizer(cfg.checkpoint.dir, cfg.checkpoint.resume)
        if spec is None:
            return None, eot, None
        eot, where = eot if eot is not None else saved_eot, f"of the resumed checkpoint ({str(spec)!r})"
    tok = load_tokenizer(spec)
    check_fits(tok, cfg.model.vocab_size, where)
    try:
        eot = find_eot(tok, spec, eot)
    except TokenizerError:
        if needs_eot:
            raise
        eot = None  # token sources may not need one
    if eot is not None and eot >= cfg.model.vocab_size:
        raise TokenizerError(f"data.eot_id={eot} is outside the vocabulary [0, {cfg.model.vocab_size})")
    return tok, eot, where


def load_corpus(cfg: RunConfig, log: Callable[[str], None]) -> Corpus:
    """Every rank prepares the corpus (each source of a blend): one builds (tokenizes, caches) it
    while the others wait on the cache's file lock, at most ``parallel.timeout_minutes`` (then the
    error names the lock and its holder). The run's output and checkpoint folders are never part
    of a corpus."""
    dc, mc = cfg.data, cfg.model
    sources = [part.source for part in dc.sources] or [dc.source]
    skip = (cfg.out_dir, cfg.checkpoint.dir, dc.cache_dir or default_cache_dir())  # never part of a corpus
    texts = [s for s in sources if source_kind(s, skip) in ("text", "records")]
    tok, eot, where = run_tokenizer(cfg, bool(texts))
    if where is not None and texts:
        log(f"data: text is encoded with the tokenizer {where}")
    if tok is None and len(texts) > 1:
        raise DataError(f"data.sources: the text sources {texts} need one shared tokenizer (each would train its "
                        f"own BPE); set data.tokenizer")
    parts = [_prepare(cfg, s, tok, eot, log) for s in sources]
    for s, corpus in zip(sources, parts):
        if corpus.vocab_size > mc.vocab_size:
            raise DataError(f"data.source={s!r} needs vocab_size >= {corpus.vocab_size}, model.vocab_size is "
                            f"{mc.vocab_size}")
    return parts[0] if not dc.sources else _blend(cfg, parts)


def _prepare(cfg: RunConfig, source: str | None, tok: Tokenizer | None, eot: int | None,
             log: Callable[[str], None]) -> Corpus:
    """:func:`prepare_corpus` of one source. An ``OSError`` naming a file is met reading the
    user's source or writing the cache (``data.cache_dir``): a :class:`DataError` naming both."""
    dc = cfg.data
    try:
        return prepare_corpus(source, vocab_size=cfg.model.vocab_size, cache_dir=dc.cache_dir, max_bytes=dc.max_bytes,
                              log=log, exclude=(cfg.out_dir, cfg.checkpoint.dir), tokenizer=tok, eot_id=eot,
                              text_field=dc.text_field, workers=dc.workers,
                              lock_timeout_s=cfg.parallel.timeout_minutes * 60)
    except OSError as e:
        if isinstance(e, DataError) or e.filename is None:
            raise
        raise DataError(f"data.source={source!r}: {e.filename}: {e.strerror or e}") from e


def _blend(cfg: RunConfig, parts: list[Corpus]) -> Corpus:
    """One corpus over a blend's parts; their tokenizers (where they have one) must agree."""
    names = [str(part.source) for part in cfg.data.sources]
    toks = {tokenizer_digest(c.tokenizer): n for n, c in zip(names, parts) if c.tokenizer is not None}
    if len(toks) > 1:
        raise DataError(f"data.sources: {sorted(toks.values())} were made with different tokenizers; blend sources "
                        f"whose ids mean the same tokens (set data.tokenizer for text sources)")
    first = next((c for c in parts if c.tokenizer is not None), parts[0])
    eot = next((c.eot_id for c in parts if c.eot_id is not None), None)
    weights = [part.weight for part in cfg.data.sources]
    return Corpus(Joined([c.tokens for c in parts]), cfg.model.vocab_size, first.tokenizer, eot,
                  any(c.tokenizer_given for c in parts), parts=tuple(parts),
                  weights=tuple(w / sum(weights) for w in weights), names=tuple(names))


def run_batches(cfg: RunConfig, corpus: Corpus, dp_rank: int, dp: int, accum: int,
                log: Callable[[str], None] | None = None) -> tuple[TokenBatches, list[Batch]]:
    """The training batches of dp rank ``dp_rank`` (a step's global batch depends only on seed and
    step) and its fixed held-out batches (none when eval is off or the split is too short). A
    blend draws from each source's training split and holds out the tail of each source; ``log``
    then gets the mix the run's steps draw, next to the weights."""
    tc, mc = cfg.train, cfg.model
    parts = corpus.parts or (corpus,)
    splits = [part.split(cfg.data.eval_fraction) for part in parts]
    shape = dict(seq_len=mc.seq_len, micro_batch=tc.micro_batch, dp_rank=dp_rank, dp_size=dp, accum=accum)
    if corpus.parts:
        batches = BlendBatches([train for train, _ in splits], list(corpus.weights), list(corpus.names),
                               seed=tc.seed, **shape)
        if log is not None:
            log(batches.mix_line(tc.steps))
    else:
        batches = TokenBatches(splits[0][0], seed=tc.seed, **shape)
    evals = [b for _, held in splits if tc.eval_interval > 0 and len(held) > mc.seq_len
             for b in eval_batches(held, num_batches=tc.eval_batches, **shape)]
    return batches, evals


def tokenizer_attachment(cfg: RunConfig, corpus: Corpus, is_first: bool) -> dict[str, Path]:
    """``{"tokenizer.json": path}`` when the corpus has a tokenizer (checkpoints carry it, so
    ``seqpar generate`` needs nothing else), with ``tokenizer_origin.json`` when it was given
    (a resume then encodes text with it again); the first rank writes the files into ``out_dir``."""
    if corpus.tokenizer is None:
        return {}
    out = Path(cfg.out_dir)
    files = {"tokenizer.json": out / "tokenizer.json"}
    if corpus.tokenizer_given:
        files[ORIGIN_FILE] = out / ORIGIN_FILE
    if is_first:
        out.mkdir(parents=True, exist_ok=True)
        corpus.tokenizer.save(str(files["tokenizer.json"]))
        if corpus.tokenizer_given:
            files[ORIGIN_FILE].write_text(json.dumps({"origin": "given", "eot_id": corpus.eot_id}))
    return files


__all__ = ["load_corpus", "run_batches", "run_tokenizer", "tokenizer_attachment"]

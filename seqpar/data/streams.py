"""A run's data: the corpus, this dp rank's training stream and eval batches, the tokenizer file."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import RunConfig
from .batches import Batch, TokenBatches, eval_batches
from .corpus import Corpus, prepare_corpus


def load_corpus(cfg: RunConfig, log: Callable[[str], None]) -> Corpus:
    """Every rank prepares the corpus: one builds (tokenizes, caches) it while the others wait
    on the cache's file lock, which has no timeout, instead of in a collective that has one.
    The run's output and checkpoint folders are never part of the corpus."""
    dc, mc = cfg.data, cfg.model
    corpus = prepare_corpus(dc.source, vocab_size=mc.vocab_size, cache_dir=dc.cache_dir, max_bytes=dc.max_bytes,
                            log=log, exclude=(cfg.out_dir, cfg.checkpoint.dir))
    if corpus.vocab_size > mc.vocab_size:
        raise ValueError(f"the corpus needs vocab_size >= {corpus.vocab_size}, model.vocab_size is {mc.vocab_size}")
    return corpus


def data_streams(cfg: RunConfig, corpus: Corpus, dp_rank: int, dp: int, accum: int
                 ) -> tuple[TokenBatches, list[Batch]]:
    """The training stream of dp rank ``dp_rank`` (a step's global batch depends only on seed and
    step) and its fixed held-out batches (none when eval is off or the split is too short)."""
    tc, mc = cfg.train, cfg.model
    train_tokens, heldout = corpus.split(cfg.data.eval_fraction)
    batches = TokenBatches(train_tokens, seq_len=mc.seq_len, micro_batch=tc.micro_batch, seed=tc.seed,
                           dp_rank=dp_rank, dp_size=dp, accum=accum)
    has_eval = tc.eval_interval > 0 and len(heldout) > mc.seq_len
    evals = (eval_batches(heldout, seq_len=mc.seq_len, micro_batch=tc.micro_batch, num_batches=tc.eval_batches,
                          dp_rank=dp_rank, dp_size=dp, accum=accum) if has_eval else [])
    return batches, evals


def tokenizer_attachment(cfg: RunConfig, corpus: Corpus, is_first: bool) -> dict[str, Path]:
    """``{"tokenizer.json": path}`` when the corpus has a tokenizer (checkpoints carry it, so
    ``seqpar generate`` needs nothing else); the first rank writes the file into ``out_dir``."""
    if corpus.tokenizer is None:
        return {}
    path = Path(cfg.out_dir) / "tokenizer.json"
    if is_first:
        corpus.tokenizer.save(str(path))
    return {"tokenizer.json": path}


__all__ = ["data_streams", "load_corpus", "tokenizer_attachment"]

"""Training data: documents -> tokenizer -> a verified token cache -> each step's batches.

    corpus.py     sources (text, datasets files, token files and folders, Megatron datasets), ``Corpus``
    kinds.py      what a source is, a data folder's side files (README, licence, metadata) skipped
    text.py       a text source's documents in pieces another process can read
    records.py    Hugging Face datasets files (jsonl, parquet, arrow) as text (the ``data`` extra)
    tokenizer.py  tokenizers users bring (data.tokenizer, a checkpoint's), their end-of-text id
    cache.py      the verified, atomically written token cache and the local BPE
    lock.py       the cache's file locks: a bounded wait that names the holder
    shards.py     a large cache encoded in shards by every rank and worker, resumable
    tokens.py     token sources read in place: shard folders, Megatron .bin/.idx
    batches.py    a step's batch cut from its global batch (dp- and micro-batch-invariant), eval batches
    blend.py      several sources mixed by weight (data.sources)
    feed.py       a run's corpus, training batches, held-out batches and tokenizer attachment from its config
    errors.py     DataError / TokenizerError: bad input named with the file or key and the value
"""
from .batches import Batch, TokenBatches, eval_batches
from .cache import EOT
from .corpus import Corpus, default_cache_dir, list_documents, open_corpus, prepare_corpus
from .feed import load_corpus, run_batches, tokenizer_attachment
from .text import Document

__all__ = ["EOT", "Batch", "Corpus", "Document", "TokenBatches", "default_cache_dir", "eval_batches",
           "list_documents", "load_corpus", "open_corpus", "prepare_corpus", "run_batches", "tokenizer_attachment"]

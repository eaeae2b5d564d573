"""Training data: documents -> tokenizer -> a verified token cache -> each step's batches.

    corpus.py   sources (text files, folders, token files), the local BPE, ``Corpus``
    cache.py    the verified, atomically written token cache and its lock
    batches.py  a step's batch cut from its global batch (dp- and micro-batch-invariant), eval batches
    streams.py  a run's training streams, held-out batches and tokenizer attachment from its config
"""
from .batches import Batch, TokenBatches, eval_batches
from .cache import EOT, Document
from .corpus import Corpus, default_cache_dir, list_documents, open_corpus, prepare_corpus
from .streams import data_streams, load_corpus, tokenizer_attachment

__all__ = ["EOT", "Batch", "Corpus", "Document", "TokenBatches", "data_streams", "default_cache_dir", "eval_batches",
           "list_documents", "load_corpus", "open_corpus", "prepare_corpus", "tokenizer_attachment"]

"""Tokenize a split once; later runs memory-map the result.

The cache sits next to the prepared tfds data (`<dataset dir>/token_cache/`) unless
`data.cache_dir` says otherwise, as two .npy files per (dataset, split, tokenizer fingerprint):

    <dataset>.<split>.<fingerprint>.tokens.npy   uint16/int32[N]   documents joined by eod
    <dataset>.<split>.<fingerprint>.docs.npy     int64[D + 1]      document start offsets

T and packing are not part of the key: windows and packed rows are cut from the same arrays.
Files are written under a temporary name and renamed, so an interrupted run never leaves a
half-written cache that a later run would trust.
"""
import hashlib
import os
from typing import Iterable, Iterator

from absl import logging
import numpy as np

from simplified_flax.data import sequences
from simplified_flax.data.corpus import Corpus
from simplified_flax.data.errors import DataError
from simplified_flax.data.sequences import TokenizedSplit
from simplified_flax.data.tokenizers import Tokenizer

_DOCS_PER_CHUNK = 512


def default_cache_dir(corpus: Corpus, workdir: str | None) -> str | None:
  """Next to the prepared data when it is local; else `<workdir>/token_cache` when that is
  local; else none (memory-mapping needs a local file; set data.cache_dir on such hosts)."""
  data_dir = os.fspath(corpus.builder.data_dir)
  if "://" not in data_dir:
    return os.path.join(data_dir, "token_cache")
  if workdir and "://" not in workdir:
    return os.path.join(workdir, "token_cache")
  return None


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer) -> TokenizedSplit:
  """All `texts` as one eod-joined split (tokenized chunk by chunk to bound memory)."""
  parts = []
  for chunk in _chunks(texts, _DOCS_PER_CHUNK):
    parts.append(sequences.join_documents(tokenizer.encode_batch(chunk), tokenizer.eod_id,
                                          tokenizer.vocab_size))
  return sequences.concat_splits(parts)


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
  chunk = []
  for item in items:
    chunk.append(item)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def load_or_tokenize(corpus: Corpus, split: str, tokenizer: Tokenizer,
                     cache_dir: str | None) -> TokenizedSplit:
  """The tokenized `split`, from the cache when present, else tokenized now (and cached)."""
  paths = _cache_paths(cache_dir, corpus, split, tokenizer) if cache_dir else None
  if paths and all(os.path.exists(p) for p in paths):
    logging.info("Reusing tokenized %s/%s from %s.", corpus.identity, split, paths[0])
    return TokenizedSplit(np.load(paths[0], mmap_mode="r"), np.load(paths[1]))
  logging.info("Tokenizing %s/%s (once; cached in %s).", corpus.identity, split, cache_dir)
  tokenized = tokenize_documents(corpus.documents(split), tokenizer)
  if tokenized.num_docs == 0:
    raise DataError(f"The split '{split}' of dataset '{corpus.identity}' is empty (no document "
                    f"with text under feature '{corpus.text_key}'). Check data.name, "
                    "data.text_key and the split names.")
  if paths:
    os.makedirs(cache_dir, exist_ok=True)
    for path, array in zip(paths, (tokenized.tokens_N, tokenized.doc_starts_D1)):
      tmp_path = f"{path}.tmp-{os.getpid()}.npy"
      np.save(tmp_path, array)
      os.replace(tmp_path, path)
  return tokenized


def _cache_paths(cache_dir: str, corpus: Corpus, split: str,
                 tokenizer: Tokenizer) -> tuple[str, str]:
  dataset = corpus.identity.replace("/", "_").replace(":", "_")
  # Split names may hold tfds slicing syntax ("train[:10%]"): hash them into a file name.
  safe = split if split.isidentifier() else "split-" + hashlib.sha256(
      split.encode()).hexdigest()[:12]
  stem = os.path.join(cache_dir, f"{dataset}.{safe}.{tokenizer.fingerprint}")
  return f"{stem}.tokens.npy", f"{stem}.docs.npy"

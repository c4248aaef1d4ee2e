"""The streaming path, for corpora too large to tokenize into memory (c4, lm1b on a TPU host).

Each process reads only its own shard of the split's documents (`tfds.even_splits`), with
tfds file shuffling and a tf.data document shuffle buffer of `data.shuffle_buffer`, both seeded;
documents are tokenized on the fly and cut into windows (or packed rows) exactly as the
in-memory path does, then pass through a second, row-level shuffle buffer of the same size
(windows of one document would otherwise arrive together).

Trade-offs against the in-memory path (`batches.py`):
  * the shuffle is approximate (buffers), not a full permutation;
  * a batch depends on the number of processes (each reads its own shard);
  * restoring a state replays the stream from the start and discards `batches_drawn` batches:
    exact, but it costs time proportional to the position (tokenizing, no training).
"""
import dataclasses
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds

from simplified_flax.data import mlm
from simplified_flax.data.batches import BatchFormat
from simplified_flax.data.corpus import Corpus
from simplified_flax.data.tokenizers import Tokenizer

_DOCS_PER_READ = 64
_ROW_SHUFFLE_TAG, _MASK_TAG = 11, 12


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  corpus: Corpus
  split: str
  tokenizer: Tokenizer
  fmt: BatchFormat
  seq_len: int
  packing: bool
  local_batch: int
  process_index: int
  process_count: int
  seed: int
  shuffle_buffer: int


def process_split(split: str, process_index: int, process_count: int) -> str:
  """This process's disjoint, equal share of `split` (the remainder is dropped)."""
  if process_count == 1:
    return split
  return tfds.even_splits(split, n=process_count, drop_remainder=True)[process_index]


def _texts(spec: StreamSpec, shuffle: bool) -> Iterator[list[str]]:
  """Chunks of documents of this process's shard; forever when shuffling (training)."""
  seed = spec.seed if shuffle else None
  ds = spec.corpus.text_dataset(process_split(spec.split, spec.process_index,
                                              spec.process_count),
                                shuffle_files=shuffle, seed=seed)
  if shuffle:
    ds = ds.shuffle(spec.shuffle_buffer, seed=spec.seed, reshuffle_each_iteration=True).repeat()
  for texts in tfds.as_numpy(ds.batch(_DOCS_PER_READ)):
    yield [t.decode("utf-8", errors="replace") for t in texts]


def _rows(spec: StreamSpec, shuffle: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """(tokens int32[T], segment_ids int32[T]) rows, in stream order (segments all 1 unless
  packing)."""
  T, eod = spec.seq_len, spec.tokenizer.eod_id
  carry_tokens = np.zeros(0, np.int32)
  carry_docs = np.zeros(0, np.int64)
  next_doc = 0
  for texts in _texts(spec, shuffle):
    docs = [d for d in spec.tokenizer.encode_batch(texts) if len(d)]
    if not spec.packing:
      for doc in docs:
        for window in doc[:len(doc) // T * T].reshape(-1, T):
          yield window, np.ones(T, np.int32)
      continue
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    stream = np.concatenate([carry_tokens] + [np.append(d, eod) for d in docs]).astype(np.int32)
    doc_ids = np.concatenate([carry_docs, np.repeat(np.arange(next_doc, next_doc + len(docs)),
                                                    lengths)])
    next_doc += len(docs)
    full = len(stream) // T * T
    for tokens, ids in zip(stream[:full].reshape(-1, T), doc_ids[:full].reshape(-1, T)):
      yield tokens, (ids - ids[0] + 1).astype(np.int32)
    carry_tokens, carry_docs = stream[full:], doc_ids[full:]
  if spec.packing and len(carry_tokens):  # only a finite (eval) stream ends: pad its last row
    pad = T - len(carry_tokens)
    yield (np.concatenate([carry_tokens, np.full(pad, spec.tokenizer.pad_id, np.int32)]),
           np.concatenate([carry_docs - carry_docs[0] + 1, np.zeros(pad)]).astype(np.int32))


def _shuffled(rows: Iterator, size: int, rng: np.random.Generator) -> Iterator:
  """A row-level shuffle buffer: fill to `size`, then emit a random slot and refill it."""
  buffer = []
  for row in rows:
    if len(buffer) < size:
      buffer.append(row)
      continue
    i = int(rng.integers(size))
    yield buffer[i]
    buffer[i] = row
  rng.shuffle(buffer)
  yield from buffer


def stream_batches(spec: StreamSpec, *, shuffle: bool) -> Iterator[dict[str, np.ndarray]]:
  """This process's batches from the start of the stream (train: shuffle=True, infinite)."""
  rows = _rows(spec, shuffle)
  if shuffle:
    rows = _shuffled(rows, max(1, spec.shuffle_buffer),
                     np.random.default_rng([spec.seed, _ROW_SHUFFLE_TAG, spec.process_index]))
  k = 0
  while True:
    batch_rows = [row for _, row in zip(range(spec.local_batch), rows)]
    if len(batch_rows) < spec.local_batch:
      return  # a finite stream's short last batch is dropped
    tokens_bxT = np.stack([t for t, _ in batch_rows])
    segments_bxT = np.stack([s for _, s in batch_rows]) if spec.packing else None
    noise = None
    if spec.fmt.kind == "encoder":
      rng = np.random.default_rng([spec.seed, _MASK_TAG, int(shuffle), spec.process_index, k])
      noise = mlm.draw_noise(rng, tokens_bxT.shape, spec.fmt.first_regular_id,
                             spec.fmt.vocab_size)
    yield spec.fmt.make(tokens_bxT, segments_bxT, noise)
    k += 1

"""`build_pipeline(config)`: corpus -> tokenizer -> rows -> batches, for training and eval.

    pipeline = build_pipeline(config, workdir=workdir)
    train_iter = pipeline.train_iterator()          # infinite; get_state()/set_state()
    batch = next(train_iter)                         # {"inputs": int32[b, T], ...}
    for batch in pipeline.eval_batches(config.eval_steps): ...

Two paths (`data.streaming`; None picks by the train split's size on disk):
  * in memory (default): the split is tokenized once into a flat array cached next to the
    prepared data and memory-mapped; batches are pure functions of (seed, batch index), see
    `batches.py`. Exact shuffle, exact O(1) resume, same batches for any process count.
  * streaming (`streaming.py`): for corpora that do not fit in memory; approximate
    (buffer) shuffle, each process reads its own file shard, resume replays the stream.
"""
import dataclasses
import itertools
from typing import Iterator

from absl import logging

from simplified_flax.data import batches
from simplified_flax.data import corpus as corpus_lib
from simplified_flax.data import streaming
from simplified_flax.data import token_cache
from simplified_flax.data import tokenizers
from simplified_flax.data.batches import BatchFormat, BatchMaker, RowSource, Sharding
from simplified_flax.data.errors import DataError
from simplified_flax.data.iterator import CheckpointableIterator

STREAM_ABOVE_BYTES = 1 << 30  # a train split larger than this on disk streams by default


class Pipeline:
  """Batches of one config for one process; see the module docstring."""

  def __init__(self, *, tokenizer: tokenizers.Tokenizer, description: dict, prefetch: int,
               train_stream, eval_stream):
    self.tokenizer = tokenizer
    self.description = description
    self._prefetch = prefetch
    self._train_stream = train_stream  # k -> iterator of batches k, k+1, ...
    self._eval_stream = eval_stream    # () -> iterator of eval batches (repeats if needed)

  def train_iterator(self) -> CheckpointableIterator:
    """A fresh iterator at batch 0; `set_state` moves it to a checkpoint's position."""
    return CheckpointableIterator(self._train_stream, self.description, prefetch=self._prefetch)

  def eval_batches(self, num_batches: int) -> Iterator[dict]:
    """The first `num_batches` eval batches: the same on every call and for every seed."""
    return itertools.islice(self._eval_stream(), num_batches)


def build_pipeline(config, *, workdir: str | None = None, process_index: int | None = None,
                   process_count: int | None = None) -> Pipeline:
  """The pipeline of `config` (uses config.data, .model.kind/.context_length, .batch_size,
  .seed). Sets `config.model.vocab_size` from the tokenizer when it is None."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  (only the default needs jax)
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  data, kind, seq_len = config.data, config.model.kind, config.model.context_length
  _check_settings(config, process_count)

  corpus = corpus_lib.open_corpus(data)
  tokenizer = tokenizers.build_tokenizer(
      data, workdir, lambda: corpus.documents(data.train_split))
  _set_vocab_size(config, tokenizer)
  fmt = BatchFormat(kind=kind, mlm_rate=data.mlm_rate, mask_id=tokenizer.mask_id,
                    first_regular_id=tokenizer.first_regular_id,
                    vocab_size=tokenizer.vocab_size)
  sharding = Sharding(config.batch_size, process_index, process_count)
  description = {
      "dataset": corpus.identity, "text_key": corpus.text_key, "split": data.train_split,
      "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
      "context_length": seq_len, "packing": bool(data.packing), "kind": kind,
      "mlm_rate": float(data.mlm_rate) if kind == "encoder" else None,
      "batch_size": config.batch_size, "seed": config.seed,
  }

  use_streaming = data.streaming
  if use_streaming is None:
    size = corpus.split_num_bytes(data.train_split)
    use_streaming = size is not None and size > STREAM_ABOVE_BYTES
  if use_streaming:
    return _streaming_pipeline(config, corpus, tokenizer, fmt, sharding, description)

  cache_dir = data.cache_dir or token_cache.default_cache_dir(corpus, workdir)
  sources = {}
  for role, split in (("train", data.train_split), ("eval", data.eval_split)):
    tokenized = token_cache.load_or_tokenize(corpus, split, tokenizer, cache_dir)
    sources[role] = RowSource(tokenized, seq_len, bool(data.packing), tokenizer.pad_id)
    _check_rows(sources[role], corpus.identity, split, config.batch_size if role == "train" else 1)
  train = BatchMaker(sources["train"], fmt, sharding, config.seed)
  evals = BatchMaker(sources["eval"], fmt, sharding, config.seed)
  description["rows_per_epoch"] = sources["train"].num_rows  # catches a changed corpus
  logging.info("Data: %s, %d train rows of %d tokens (%d batches per epoch), %d eval rows.",
               corpus.identity, sources["train"].num_rows, seq_len, train.batches_per_epoch,
               sources["eval"].num_rows)
  return Pipeline(
      tokenizer=tokenizer, description=description, prefetch=data.prefetch,
      train_stream=lambda k: map(train.train_batch, itertools.count(k)),
      eval_stream=lambda: map(evals.eval_batch, itertools.count()))


def _streaming_pipeline(config, corpus, tokenizer, fmt, sharding, description) -> Pipeline:
  data = config.data
  spec = streaming.StreamSpec(
      corpus=corpus, split=data.train_split, tokenizer=tokenizer, fmt=fmt,
      seq_len=config.model.context_length, packing=bool(data.packing),
      local_batch=sharding.local_batch, process_index=sharding.process_index,
      process_count=sharding.process_count, seed=config.seed,
      shuffle_buffer=data.shuffle_buffer)
  eval_spec = dataclasses.replace(spec, split=data.eval_split, seed=batches.EVAL_SEED)
  # In this path a batch depends on the shard layout, so a restore must match it too.
  description = {**description, "streaming": True, "process_count": sharding.process_count,
                 "shuffle_buffer": data.shuffle_buffer}

  def train_stream(k: int):
    return itertools.islice(streaming.stream_batches(spec, shuffle=True), k, None)

  def eval_stream():
    first = next(streaming.stream_batches(eval_spec, shuffle=False), None)
    if first is None:
      raise DataError(f"The eval split '{data.eval_split}' of '{corpus.identity}' gives no full "
                      f"batch of {sharding.local_batch} rows on this process. Use a larger "
                      "eval split or a smaller batch.")
    return itertools.chain.from_iterable(
        streaming.stream_batches(eval_spec, shuffle=False) for _ in itertools.count())

  logging.info("Data: streaming %s (shuffle buffer %d).", corpus.identity, data.shuffle_buffer)
  return Pipeline(tokenizer=tokenizer, description=description, prefetch=data.prefetch,
                  train_stream=train_stream, eval_stream=eval_stream)


def _check_settings(config, process_count: int) -> None:
  if config.model.kind not in ("decoder", "encoder"):
    raise DataError(f"model.kind is '{config.model.kind}'; the data pipeline makes batches for "
                    "'decoder' (LM) or 'encoder' (MLM).")
  if config.batch_size % process_count:
    raise DataError(f"batch_size {config.batch_size} (global) does not divide over "
                    f"{process_count} processes; make it a multiple of {process_count}.")
  if config.model.kind == "encoder" and not 0.0 < config.data.mlm_rate < 1.0:
    raise DataError(f"data.mlm_rate is {config.data.mlm_rate}; it must lie in (0, 1).")


def _set_vocab_size(config, tokenizer: tokenizers.Tokenizer) -> None:
  """The tokenizer decides the vocabulary; a config that fixes a smaller one is an error."""
  vocab_size = config.model.vocab_size
  if vocab_size is None:
    config.model.vocab_size = tokenizer.vocab_size  # an existing field: allowed when locked
  elif vocab_size < tokenizer.vocab_size:
    raise DataError(f"model.vocab_size is {vocab_size} but the tokenizer has "
                    f"{tokenizer.vocab_size} ids; leave model.vocab_size unset (None) to take it "
                    "from the tokenizer.")


def _check_rows(source: RowSource, dataset: str, split: str, needed: int) -> None:
  if source.num_rows < needed:
    hint = "" if source.packing else " or set data.packing=True (short documents then count)"
    raise DataError(f"The split '{split}' of '{dataset}' gives {source.num_rows} rows of "
                    f"{source.seq_len} tokens, fewer than the {needed} a batch needs. Use more "
                    f"data, a smaller batch_size or model.context_length{hint}.")

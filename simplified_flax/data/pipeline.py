"""`build_pipeline(config)`: corpus -> tokenizer -> prepared shards -> rows -> batches (usage
and batch layouts: `simplified_flax.data`; order and resume: `batches.py`).

Both splits are read from prepared token shards (`shards.py`) under `data.cache_dir`. When a
split is not prepared yet, a small one (up to PREPARE_IN_PROCESS_BYTES on disk) is prepared
here, in this process; a larger one is an error that prints the exact
`python -m simplified_flax.prepare` command, which uses worker processes and survives a kill.
"""
import itertools
import os
import shlex
import sys
from typing import Iterator

from absl import logging

from simplified_flax.data import corpus as corpus_lib
from simplified_flax.data import preparation
from simplified_flax.data import tokenizers
from simplified_flax.data.batches import BatchFormat, BatchMaker, Sharding
from simplified_flax.data.errors import DataError
from simplified_flax.data.iterator import CheckpointableIterator
from simplified_flax.data.rows import ShardedRows
from simplified_flax.data.shards import Address, PreparedSplit

PREPARE_IN_PROCESS_BYTES = 1 << 30  # a larger unprepared split asks for the prepare command


class Pipeline:
  """Batches of one config for one process; see the module docstring."""

  def __init__(self, *, tokenizer: tokenizers.Tokenizer, description: dict, prefetch: int,
               train: BatchMaker, evals: BatchMaker):
    self.tokenizer = tokenizer
    self.description = description
    self._prefetch = prefetch
    self._train = train
    self._evals = evals

  def train_iterator(self, prefetch: int | None = None) -> CheckpointableIterator:
    """A fresh iterator at batch 0; `set_state` moves it to a checkpoint's position.
    `prefetch` overrides data.prefetch (0: no thread, for a consumer with its own)."""
    return CheckpointableIterator(
        lambda k: map(self._train.train_batch, itertools.count(k)), self.description,
        prefetch=self._prefetch if prefetch is None else prefetch,
        batches_per_epoch=self._train.batches_per_epoch)

  def eval_batches(self, num_batches: int) -> Iterator[dict]:
    """The first `num_batches` eval batches: the same on every call and for every seed."""
    return map(self._evals.eval_batch, range(num_batches))


def shard_root(data_config) -> str:
  """`data.cache_dir`, else `token_shards/` in tfds's data directory (local or remote)."""
  if data_config.cache_dir:
    return data_config.cache_dir
  tfds_dir = data_config.tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.join(
      os.path.expanduser("~"), "tensorflow_datasets")
  return os.path.join(tfds_dir, "token_shards")


def prepare_command() -> str:
  """The prepare command for this run's config (its --config flags, when started with any)."""
  flags = [a for a in sys.argv[1:] if a.startswith("--config")]
  return shlex.join(["python", "-m", "simplified_flax.prepare",
                     *(flags or ["--config=configs/<your variant>.py"])])


def open_or_prepare(corpus, split: str, tokenizer, data_config) -> PreparedSplit:
  """The prepared split; a small unprepared one is prepared now (see the module docstring)."""
  root = shard_root(data_config)
  address = Address(corpus.identity, split, tokenizer.fingerprint, data_config.shard_docs)
  prepared = PreparedSplit.open(root, address)
  if prepared is not None:
    logging.info("Reading prepared %s/%s from %s.", corpus.identity, split,
                 address.directory(root))
    return prepared
  size = corpus.split_num_bytes(split)
  if size is not None and size > PREPARE_IN_PROCESS_BYTES:
    raise DataError(f"The split '{split}' of '{corpus.identity}' ({size / 2**30:.1f} GiB) is not "
                    f"prepared in '{root}'. Tokenize it once, with worker processes (resumable):"
                    f"  {prepare_command()}")
  logging.info("Preparing %s/%s in %s (once).", corpus.identity, split, root)
  return preparation.prepare_split(corpus, split, tokenizer, root,
                                   shard_docs=data_config.shard_docs, workers=1)


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
  sources = {}
  for role, split in (("train", data.train_split), ("eval", data.eval_split)):
    prepared = open_or_prepare(corpus, split, tokenizer, data)
    sources[role] = ShardedRows(prepared, seq_len=seq_len, packing=bool(data.packing),
                                pad_id=tokenizer.pad_id)
    _check_rows(sources[role], corpus.identity, split, config.batch_size if role == "train" else 1)
  train = BatchMaker(sources["train"], fmt, sharding, config.seed)
  evals = BatchMaker(sources["eval"], fmt, sharding, config.seed)
  description = {
      "dataset": corpus.identity, "text_key": corpus.text_key, "split": data.train_split,
      "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
      "shard_docs": data.shard_docs, "context_length": seq_len, "packing": bool(data.packing),
      "kind": kind, "mlm_rate": float(data.mlm_rate) if kind == "encoder" else None,
      "batch_size": config.batch_size, "seed": config.seed,
      "rows_per_epoch": sources["train"].num_rows,  # catches a changed corpus
  }
  logging.info("Data: %s, %d train rows of %d tokens (%d batches per epoch), %d eval rows.",
               corpus.identity, sources["train"].num_rows, seq_len, train.batches_per_epoch,
               sources["eval"].num_rows)
  return Pipeline(tokenizer=tokenizer, description=description, prefetch=data.prefetch,
                  train=train, evals=evals)


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


def _check_rows(source: ShardedRows, dataset: str, split: str, needed: int) -> None:
  if source.num_rows < needed:
    hint = "" if source.packing else " or set data.packing=True (short documents then count)"
    raise DataError(f"The split '{split}' of '{dataset}' gives {source.num_rows} rows of "
                    f"{source.seq_len} tokens, fewer than the {needed} a batch needs. Use more "
                    f"data, a smaller batch_size or model.context_length{hint}.")

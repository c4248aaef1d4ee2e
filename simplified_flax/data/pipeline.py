"""`build_pipeline(config)`: corpus -> tokenizer -> prepared shards -> rows -> batches (usage
and batch layouts: `simplified_flax.data`). A split not prepared yet is prepared in this
process when it is small (up to PREPARE_IN_PROCESS_BYTES on disk); a larger one is an error
that prints the `python -m simplified_flax.prepare` command (worker processes, resumable).
"""
import dataclasses
import itertools
import os
from typing import Iterator

from absl import logging

from simplified_flax.data import corpus
from simplified_flax.data import preparation
from simplified_flax.data import tokenizers
from simplified_flax.data.batches import BatchMaker
from simplified_flax.data.errors import DataError
from simplified_flax.data.iterator import CheckpointableIterator
from simplified_flax.data.sequences import ShardedRows

PREPARE_IN_PROCESS_BYTES = 1 << 30  # a larger unprepared split asks for the prepare command


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """Batches of one config for one process."""
  tokenizer: tokenizers.Tokenizer
  description: dict  # what the iterator state records and checks on restore
  prefetch: int
  train: BatchMaker
  evals: BatchMaker

  def train_iterator(self, prefetch: int | None = None) -> CheckpointableIterator:
    """A fresh iterator at batch 0; `prefetch` overrides data.prefetch (0: no thread)."""
    return CheckpointableIterator(
        lambda k: map(self.train.train_batch, itertools.count(k)), self.description,
        prefetch=self.prefetch if prefetch is None else prefetch,
        batches_per_epoch=self.train.batches_per_epoch)

  def eval_batches(self, num_batches: int) -> Iterator[dict]:
    """The first `num_batches` eval batches: the same on every call and for every seed."""
    return map(self.evals.eval_batch, range(num_batches))


def shard_root(data_config) -> str:
  """`data.cache_dir`, else `token_shards/` in tfds's data directory (local or remote)."""
  if data_config.cache_dir:
    return data_config.cache_dir
  tfds_dir = data_config.tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.join(
      os.path.expanduser("~"), "tensorflow_datasets")
  return os.path.join(tfds_dir, "token_shards")


def build_pipeline(config, *, workdir: str | None = None, process_index: int | None = None,
                   process_count: int | None = None) -> Pipeline:
  """The pipeline of a checked `config` (uses config.data, .model.kind/.context_length,
  .batch_size, .seed). Sets `config.model.vocab_size` from the tokenizer when it is None."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  (only the default needs jax)
    process_index, process_count = jax.process_index(), jax.process_count()
  data, kind, seq_len = config.data, config.model.kind, config.model.context_length
  assert kind in ("decoder", "encoder") and 0 < data.mlm_rate < 1, "an unchecked config"
  if config.batch_size % process_count:
    raise DataError(f"batch_size {config.batch_size} (global) does not divide over "
                    f"{process_count} processes; make it a multiple of {process_count}.")
  train_source, eval_source = corpus.open_corpora(data)   # one corpus unless data.eval_name
  tokenizer = tokenizers.build_tokenizer(data, workdir,
                                         lambda: train_source.documents(data.train_split))
  if kind == "encoder" and tokenizer.mask_id is None:
    raise DataError(f"data.tokenizer '{data.tokenizer}' has no mask token (<mask> or [MASK]), "
                    "which the MLM encoder needs. Use a tokenizer with one, or 'bpe' / "
                    "'sentencepiece'.")
  if config.model.vocab_size is None:  # the tokenizer decides; a smaller fixed one is an error
    config.model.vocab_size = tokenizer.vocab_size  # an existing field: allowed when locked
  elif config.model.vocab_size < tokenizer.vocab_size:
    raise DataError(f"model.vocab_size is {config.model.vocab_size} but the tokenizer has "
                    f"{tokenizer.vocab_size} ids; leave model.vocab_size unset (None) to take it "
                    "from the tokenizer.")
  makers = []   # train, eval: each a split of its own corpus (shards addressed by both)
  for source, split, needed in ((train_source, data.train_split, config.batch_size),
                                (eval_source, data.eval_split, 1)):
    prepared = preparation.prepare_split(source, split, tokenizer, shard_root(data),
                                         shard_docs=data.shard_docs,
                                         max_bytes=PREPARE_IN_PROCESS_BYTES)
    rows = ShardedRows(prepared, seq_len=seq_len, packing=bool(data.packing),
                       pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size)
    if rows.num_rows < needed:
      hint = "" if data.packing else " or set data.packing=True (short documents then count)"
      raise DataError(f"The split '{split}' of '{source.identity}' gives {rows.num_rows} rows of "
                      f"{seq_len} tokens, fewer than the {needed} a batch needs. Use more data, "
                      f"a smaller batch_size or model.context_length{hint}.")
    makers.append(BatchMaker(rows, kind=kind, mlm_rate=data.mlm_rate, tokenizer=tokenizer,
                             global_batch=config.batch_size, process_index=process_index,
                             process_count=process_count, seed=config.seed))
  train, evals = makers
  description = {
      "dataset": train_source.identity, "text_key": train_source.text_key,
      "split": data.train_split,
      "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
      "shard_docs": data.shard_docs, "context_length": seq_len, "packing": bool(data.packing),
      "kind": kind, "mlm_rate": float(data.mlm_rate) if kind == "encoder" else None,
      "batch_size": config.batch_size, "seed": config.seed,
      "rows_per_epoch": train.source.num_rows,  # catches a changed corpus
  }
  logging.info("Data: %s, %d train rows of %d tokens (%d batches per epoch), %d eval rows%s.",
               train_source.identity, train.source.num_rows, seq_len, train.batches_per_epoch,
               evals.source.num_rows,
               "" if eval_source is train_source else f" of {eval_source.identity}")
  return Pipeline(tokenizer=tokenizer, description=description, prefetch=data.prefetch,
                  train=train, evals=evals)

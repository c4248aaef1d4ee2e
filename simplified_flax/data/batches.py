"""Batches of a prepared split: pure functions of (seed, batch index).

Epoch e visits the R rows in the order of a bijection perm_e seeded by (seed, e)
(`index_shuffle.py`: global across shards, never materialised); global batch k holds rows
perm_e(j*B .. (j+1)*B - 1), e, j = divmod(k, R // B) (an epoch's last R mod B rows are
skipped). Process p of P reads only the p-th contiguous B / P of them: disjoint, together the
global batch, the stream independent of P. Batch k needs no earlier batch, so the iterator
state is (epoch, position in epoch, seed).
"""
import functools

import numpy as np

from simplified_flax.data import mlm
from simplified_flax.data.index_shuffle import IndexShuffle
from simplified_flax.data.sequences import ShardedRows

# Independent random streams per purpose, all derived from the config seed.
_TRAIN_ORDER, _TRAIN_MASKS, _EVAL_ORDER, _EVAL_MASKS = 1, 2, 3, 4
EVAL_SEED = 0  # eval windows and masks ignore config.seed, so every run scores the same data


class BatchMaker:
  """This process's part of global batch k of the training stream or of the fixed eval stream.
  Batches as in `simplified_flax.data`; `tokenizer` gives the special and MLM ids."""

  def __init__(self, source: ShardedRows, *, kind: str, mlm_rate: float, tokenizer,
               global_batch: int, process_index: int, process_count: int, seed: int):
    self.source, self.kind, self.mlm_rate, self.tokenizer = source, kind, mlm_rate, tokenizer
    self.global_batch, self.seed = global_batch, seed
    local_batch = global_batch // process_count
    self._local = slice(process_index * local_batch, (process_index + 1) * local_batch)
    self.batches_per_epoch = source.num_rows // global_batch
    self._eval_order = IndexShuffle(max(source.num_rows, 1), [EVAL_SEED, _EVAL_ORDER])

  def _positions(self, k: int) -> np.ndarray:
    """int64[b]: this process's positions in global batch k, k * B + (its slice of 0..B-1)."""
    return k * self.global_batch + np.arange(self._local.start, self._local.stop)

  @functools.lru_cache(maxsize=2)
  def _order(self, epoch: int) -> IndexShuffle:
    return IndexShuffle(self.source.num_rows, [self.seed, _TRAIN_ORDER, epoch])

  def train_batch(self, k: int) -> dict[str, np.ndarray]:
    epoch, j = divmod(k, self.batches_per_epoch)
    return self._batch(self._order(epoch)(self._positions(j)), [self.seed, _TRAIN_MASKS, k])

  def eval_batch(self, k: int) -> dict[str, np.ndarray]:
    """Batch k of the eval split, wrapping around a split of fewer than (k+1)*B rows; a fixed
    shuffle spreads the eval batches over the whole split, not its first documents."""
    positions_b = self._positions(k) % self.source.num_rows
    return self._batch(self._eval_order(positions_b), [EVAL_SEED, _EVAL_MASKS, k])

  def _batch(self, ids_b: np.ndarray, mask_seed: list[int]) -> dict[str, np.ndarray]:
    tokens_bxT, segments_bxT = self.source.rows(ids_b)
    if self.kind == "decoder":
      batch = {"inputs": tokens_bxT}
    else:
      tok = self.tokenizer
      noise = mlm.draw_noise(np.random.default_rng(mask_seed),
                             (self.global_batch, self.source.seq_len), tok.first_regular_id,
                             tok.vocab_size, rows=self._local)
      batch = mlm.apply_mask(tokens_bxT, noise, rate=self.mlm_rate, mask_id=tok.mask_id,
                             first_regular_id=tok.first_regular_id)
      batch["key_mask"] = (segments_bxT > 0 if segments_bxT is not None
                           else np.ones(tokens_bxT.shape, bool))
    if segments_bxT is not None:
      batch["segment_ids"] = segments_bxT
    return batch

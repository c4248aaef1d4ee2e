"""Batches of a prepared split: pure functions of (seed, batch index).

The global training stream: epoch e visits every row once in the order of a bijection
`perm_e` of the R row ids seeded by (seed, e) (`index_shuffle.py`: a global shuffle across all
shards that is computed per index, never materialised); global batch k holds rows
perm_e(j*B .. (j+1)*B - 1) with e, j = divmod(k, R // B) (the R mod B rows left at an epoch's
end are skipped that epoch). Process p of P computes and reads only the p-th contiguous slice
of b = B / P positions of each global batch, so the processes' rows are disjoint, together
they are the global batch, and the stream does not depend on P.

So batch k needs no earlier batch: the iterator state is (epoch, position in epoch, seed).
"""
import dataclasses
from typing import Protocol

import numpy as np

from simplified_flax.data import mlm
from simplified_flax.data.index_shuffle import IndexShuffle

# Independent random streams per purpose, all derived from the config seed.
_TRAIN_ORDER, _TRAIN_MASKS, _EVAL_ORDER, _EVAL_MASKS = 1, 2, 3, 4
EVAL_SEED = 0  # eval windows and masks ignore config.seed, so every run scores the same data


class Rows(Protocol):
  """Rows named by ids 0 .. num_rows - 1 (`rows.py`)."""
  num_rows: int
  seq_len: int

  def rows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]: ...


@dataclasses.dataclass(frozen=True)
class BatchFormat:
  """How rows become a model batch (see `simplified_flax.data` for the dict layouts)."""
  kind: str               # "decoder" (LM) or "encoder" (MLM)
  mlm_rate: float
  mask_id: int
  first_regular_id: int
  vocab_size: int

  def make(self, tokens_bxT: np.ndarray, segments_bxT: np.ndarray | None,
           noise: mlm.MaskNoise | None) -> dict[str, np.ndarray]:
    if self.kind == "decoder":
      batch = {"inputs": tokens_bxT}
    else:
      batch = mlm.apply_mask(tokens_bxT, noise, rate=self.mlm_rate, mask_id=self.mask_id,
                             first_regular_id=self.first_regular_id)
      batch["key_mask"] = (segments_bxT > 0 if segments_bxT is not None
                           else np.ones(tokens_bxT.shape, bool))
    if segments_bxT is not None:
      batch["segment_ids"] = segments_bxT
    return batch


@dataclasses.dataclass(frozen=True)
class Sharding:
  """This process's slice of every global batch."""
  global_batch: int
  process_index: int
  process_count: int

  @property
  def rows(self) -> slice:
    local_batch = self.global_batch // self.process_count
    return slice(self.process_index * local_batch, (self.process_index + 1) * local_batch)

  def positions(self, k: int) -> np.ndarray:
    """int64[b]: k * B + this process's slice of 0 .. B - 1 (its positions in batch k)."""
    return k * self.global_batch + np.arange(self.rows.start, self.rows.stop)


class BatchMaker:
  """Global batch k of the training stream or of the fixed evaluation stream."""

  def __init__(self, source: Rows, fmt: BatchFormat, sharding: Sharding, seed: int):
    self.source, self.fmt, self.sharding, self.seed = source, fmt, sharding, seed
    self.batches_per_epoch = source.num_rows // sharding.global_batch
    self._epoch_order = (-1, None)  # (epoch, IndexShuffle), swapped atomically
    self._eval_order = IndexShuffle(max(source.num_rows, 1), [EVAL_SEED, _EVAL_ORDER])

  def _order(self, epoch: int) -> IndexShuffle:
    cached_epoch, order = self._epoch_order
    if cached_epoch != epoch:
      order = IndexShuffle(self.source.num_rows, [self.seed, _TRAIN_ORDER, epoch])
      self._epoch_order = (epoch, order)
    return order

  def train_batch(self, k: int) -> dict[str, np.ndarray]:
    epoch, j = divmod(k, self.batches_per_epoch)
    ids_b = self._order(epoch)(self.sharding.positions(j))
    return self._batch(ids_b, [self.seed, _TRAIN_MASKS, k])

  def eval_batch(self, k: int) -> dict[str, np.ndarray]:
    """Batch k of the eval split; wraps around when the split has fewer than (k+1)*B rows.
    A fixed shuffle spreads the eval batches over the whole split, not its first documents."""
    positions_b = self.sharding.positions(k) % self.source.num_rows
    return self._batch(self._eval_order(positions_b), [EVAL_SEED, _EVAL_MASKS, k])

  def _batch(self, ids_b: np.ndarray, mask_seed: list[int]) -> dict[str, np.ndarray]:
    """This process's rows `ids_b` as a batch; MLM noise is drawn for the global batch and
    sliced, so masks do not depend on the process count."""
    tokens_bxT, segments_bxT = self.source.rows(ids_b)
    noise = None
    if self.fmt.kind == "encoder":
      local = self.sharding.rows
      noise = mlm.draw_noise(np.random.default_rng(mask_seed),
                             (self.sharding.global_batch, self.source.seq_len),
                             self.fmt.first_regular_id,
                             self.fmt.vocab_size).rows(local.start, local.stop)
    return self.fmt.make(tokens_bxT, segments_bxT, noise)

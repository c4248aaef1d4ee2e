"""Rows and batches of an in-memory tokenized split: pure functions of (seed, batch index).

The global training stream: epoch e visits every row once in the order of a permutation
seeded by (seed, e); global batch k holds rows perm[j*B : (j+1)*B] of epoch k // (R // B)
(j = k mod (R // B); the R mod B rows left at an epoch's end are skipped that epoch). Process p
of P yields the p-th contiguous slice of b = B / P rows of each global batch, so the processes'
rows are disjoint, together they are the global batch, and the stream does not depend on P.

The shuffle is exact (a full permutation), so `data.shuffle_buffer` plays no part here.
"""
import dataclasses
import functools

import numpy as np

from simplified_flax.data import mlm
from simplified_flax.data import sequences
from simplified_flax.data.sequences import TokenizedSplit

# Independent random streams per purpose, all derived from the config seed.
_TRAIN_ORDER, _TRAIN_MASKS, _EVAL_ORDER, _EVAL_MASKS = 1, 2, 3, 4
EVAL_SEED = 0  # eval windows and masks ignore config.seed, so every run scores the same data


@dataclasses.dataclass(frozen=True)
class RowSource:
  """The rows of one split: windows of exactly T tokens, or packed rows with segment ids."""
  split: TokenizedSplit
  seq_len: int
  packing: bool
  pad_id: int

  @functools.cached_property
  def _window_starts(self) -> np.ndarray:
    return sequences.window_starts(self.split, self.seq_len)

  @property
  def num_rows(self) -> int:
    if self.packing:
      return sequences.num_packed_rows(self.split, self.seq_len)
    return len(self._window_starts)

  def rows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens int32[B, T], segment_ids int32[B, T] or None without packing)."""
    if self.packing:
      return sequences.gather_packed_rows(self.split, ids_B, self.seq_len, self.pad_id)
    return sequences.gather_windows(self.split.tokens_N, self._window_starts[ids_B],
                                    self.seq_len), None


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
  def local_batch(self) -> int:
    return self.global_batch // self.process_count

  @property
  def rows(self) -> slice:
    start = self.process_index * self.local_batch
    return slice(start, start + self.local_batch)


class BatchMaker:
  """Global batch k of the training stream or of the fixed evaluation stream."""

  def __init__(self, source: RowSource, fmt: BatchFormat, sharding: Sharding, seed: int):
    self.source, self.fmt, self.sharding, self.seed = source, fmt, sharding, seed
    self.batches_per_epoch = source.num_rows // sharding.global_batch
    self._cached_permutation = (-1, np.zeros(0, np.int64))  # (epoch, order), swapped atomically

  def _permutation(self, epoch: int) -> np.ndarray:
    cached_epoch, order = self._cached_permutation
    if cached_epoch != epoch:
      order = np.random.default_rng([self.seed, _TRAIN_ORDER, epoch]).permutation(
          self.source.num_rows)
      self._cached_permutation = (epoch, order)
    return order

  @functools.cached_property
  def _eval_order(self) -> np.ndarray:
    # A fixed shuffle spreads the eval batches over the whole split, not its first documents.
    return np.random.default_rng([EVAL_SEED, _EVAL_ORDER]).permutation(self.source.num_rows)

  def train_batch(self, k: int) -> dict[str, np.ndarray]:
    epoch, j = divmod(k, self.batches_per_epoch)
    B = self.sharding.global_batch
    ids_B = self._permutation(epoch)[j * B:(j + 1) * B]
    return self._batch(ids_B, [self.seed, _TRAIN_MASKS, k])

  def eval_batch(self, k: int) -> dict[str, np.ndarray]:
    """Batch k of the eval split; wraps around when the split has fewer than (k+1)*B rows."""
    B = self.sharding.global_batch
    ids_B = self._eval_order[(k * B + np.arange(B)) % self.source.num_rows]
    return self._batch(ids_B, [EVAL_SEED, _EVAL_MASKS, k])

  def _batch(self, ids_B: np.ndarray, mask_seed: list[int]) -> dict[str, np.ndarray]:
    local = self.sharding.rows
    tokens_bxT, segments_bxT = self.source.rows(ids_B[local])
    noise = None
    if self.fmt.kind == "encoder":
      # Drawn for the whole global batch, then sliced: masks do not depend on process count.
      noise = mlm.draw_noise(np.random.default_rng(mask_seed),
                             (len(ids_B), self.source.seq_len), self.fmt.first_regular_id,
                             self.fmt.vocab_size).rows(local.start, local.stop)
    return self.fmt.make(tokens_bxT, segments_bxT, noise)

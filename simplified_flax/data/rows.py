"""Rows of exactly T tokens, named by integer ids, over one tokenized array or many shards.

    rows = ShardedRows(prepared_split, seq_len=T, packing=False, pad_id=0)
    rows.num_rows                         # windows (or packed rows) of all shards together
    tokens_BxT, segments_BxT = rows.rows(ids_B)

Row ids run shard after shard (shard 0's rows, then shard 1's, ...), so a global shuffle is a
shuffle of ids and a batch gathers its rows from whichever shards hold them. With packing,
each shard's stream is packed on its own (its last row padded), see `sequences.py`.
"""
import dataclasses
import functools
from typing import Callable

import numpy as np

from simplified_flax.data import sequences
from simplified_flax.data.sequences import TokenizedSplit
from simplified_flax.data.shards import PreparedSplit


def count_rows(num_tokens: int, doc_starts: Callable[[], np.ndarray], seq_len: int,
               packing: bool) -> int:
  """The rows of one tokenized array: packed rows from its token count alone, windows from
  its document offsets (`doc_starts()` is called only then)."""
  if packing:
    return int(sequences.num_packed_rows(num_tokens, seq_len))
  return int(sequences.windows_per_doc(doc_starts(), seq_len).sum())


@dataclasses.dataclass(frozen=True)
class RowSource:
  """The rows of one tokenized array: windows of exactly T tokens, or packed rows."""
  split: TokenizedSplit
  seq_len: int
  packing: bool
  pad_id: int

  @functools.cached_property
  def _window_starts(self) -> np.ndarray:
    return sequences.window_starts(self.split, self.seq_len)

  @property
  def num_rows(self) -> int:
    return count_rows(len(self.split.tokens_N), lambda: self.split.doc_starts_D1, self.seq_len,
                      self.packing)

  def rows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens int32[B, T], segment_ids int32[B, T] or None without packing)."""
    if self.packing:
      return sequences.gather_packed_rows(self.split, ids_B, self.seq_len, self.pad_id)
    return sequences.gather_windows(self.split.tokens_N, self._window_starts[ids_B],
                                    self.seq_len), None


class ShardedRows:
  """The rows of every shard of a prepared split, under one id space (see module doc)."""

  def __init__(self, prepared: PreparedSplit, *, seq_len: int, packing: bool, pad_id: int):
    self.seq_len, self.packing, self._pad_id = seq_len, packing, pad_id
    self._prepared = prepared
    # From the manifest's token counts, or the document offsets: no shard's tokens are read.
    rows_S = [count_rows(n, functools.partial(prepared.doc_starts, i), seq_len, packing)
              for i, n in enumerate(prepared.shard_num_tokens)]
    self._first_row_S1 = np.concatenate([[0], np.cumsum(rows_S)]).astype(np.int64)
    self.num_rows = int(self._first_row_S1[-1])

  @functools.lru_cache(maxsize=None)
  def _source(self, shard: int) -> RowSource:
    """Shard `shard`'s rows, opened the first time a batch needs one."""
    return RowSource(self._prepared.shard(shard), self.seq_len, self.packing, self._pad_id)

  def rows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens int32[B, T], segment_ids int32[B, T] or None without packing), in ids order."""
    ids_B = np.asarray(ids_B, np.int64)
    shard_B = np.searchsorted(self._first_row_S1, ids_B, side="right") - 1
    tokens_BxT = np.empty((len(ids_B), self.seq_len), np.int32)
    segments_BxT = np.empty((len(ids_B), self.seq_len), np.int32) if self.packing else None
    for shard in np.unique(shard_B):
      here = np.flatnonzero(shard_B == shard)
      tokens, segments = self._source(int(shard)).rows(ids_B[here] - self._first_row_S1[shard])
      tokens_BxT[here] = tokens
      if segments_BxT is not None:
        segments_BxT[here] = segments
    return tokens_BxT, segments_BxT

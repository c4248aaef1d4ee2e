"""From tokenized shards to rows of exactly T tokens: windows (the paper's way) or packing.

A tokenized split or shard is one flat array, every document followed by one eod id:
tokens_N = [d0 d0 d0 eod d1 d1 eod ...], doc_starts_D1 = [0, 4, 7, ..., N]. Windows: each
document cut into windows of exactly T tokens, its short tail (and the eod) dropped, as in the
reference code. Packing: the eod-joined stream cut into rows of T, the last one padded;
segment_ids number a row's documents 1, 2, ... (a document cut by a row boundary is segment 1
of the next row), 0 on padding. Rows are numbered shard after shard (`ShardedRows`).
"""
import dataclasses
import functools

import numpy as np

from simplified_flax.data import shard_checks


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """A split or shard as one flat array (see the module docstring); may be memory-mapped."""
  tokens_N: np.ndarray       # uint16 or int32 ids, documents joined by eod
  doc_starts_D1: np.ndarray  # int64, D + 1 offsets into tokens_N


def join_documents(flat_M: np.ndarray, lengths_D: np.ndarray, eod_id: int,
                   vocab_size: int) -> TokenizedSplit:
  """Documents given as one flat id array and their lengths, each followed by `eod_id`;
  empty documents are dropped. uint16 storage when every id fits (half the memory)."""
  lengths_D = lengths_D[lengths_D > 0]
  tokens_N = np.full(len(flat_M) + len(lengths_D), eod_id,
                     np.uint16 if vocab_size <= 1 << 16 else np.int32)
  doc_starts_D1 = np.concatenate([[0], np.cumsum(lengths_D + 1)]).astype(np.int64)
  # Token j of the flat array lands after the eods of the documents before it.
  tokens_N[np.arange(len(flat_M)) + np.repeat(np.arange(len(lengths_D)), lengths_D)] = flat_M
  return TokenizedSplit(tokens_N, doc_starts_D1)


def windows_per_doc(doc_starts_D1: np.ndarray, seq_len: int) -> np.ndarray:
  """int64[D]: how many full windows of `seq_len` tokens each document holds (eod excluded)."""
  return (np.diff(doc_starts_D1) - 1) // seq_len


def window_starts(split: TokenizedSplit, seq_len: int) -> np.ndarray:
  """int64[W]: the start of every full window of `seq_len` tokens, document by document."""
  windows_D = windows_per_doc(split.doc_starts_D1, seq_len)
  first_window_D = np.cumsum(windows_D) - windows_D
  # Window w of doc d starts at doc_start[d] + T * (w - first_window[d]).
  doc_of_window_W = np.repeat(np.arange(len(windows_D)), windows_D)
  offset_in_doc_W = np.arange(len(doc_of_window_W)) - first_window_D[doc_of_window_W]
  return split.doc_starts_D1[:-1][doc_of_window_W] + seq_len * offset_in_doc_W


def gather_windows(tokens_N: np.ndarray, starts_B: np.ndarray, seq_len: int) -> np.ndarray:
  """int32[B, T]: the windows starting at `starts_B`."""
  return tokens_N[starts_B[:, None] + np.arange(seq_len)].astype(np.int32)


def num_packed_rows(num_tokens: int, seq_len: int) -> int:
  return -(-num_tokens // seq_len)


def gather_packed_rows(split: TokenizedSplit, rows_B: np.ndarray, seq_len: int,
                       pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32[B, T], segment_ids int32[B, T]) of packed rows `rows_B`."""
  positions_BxT = rows_B[:, None].astype(np.int64) * seq_len + np.arange(seq_len)
  real_BxT = positions_BxT < len(split.tokens_N)
  safe_BxT = np.where(real_BxT, positions_BxT, 0)
  tokens_BxT = np.where(real_BxT, split.tokens_N[safe_BxT], pad_id).astype(np.int32)
  doc_BxT = np.searchsorted(split.doc_starts_D1, safe_BxT, side="right") - 1
  segments_BxT = doc_BxT - doc_BxT[:, :1] + 1
  return tokens_BxT, np.where(real_BxT, segments_BxT, 0).astype(np.int32)


class ShardedRows:
  """The rows (windows or packed rows) of every shard of a prepared split (`preparation.py`),
  numbered shard after shard; with packing, each shard is packed on its own. With
  `vocab_size`, every row's ids are checked to lie in [0, vocab_size) as it is read (a DataError
  naming the shard file and the token's offset in it)."""

  def __init__(self, prepared, *, seq_len: int, packing: bool, pad_id: int,
               vocab_size: int | None = None):
    self.seq_len, self.packing, self._pad_id, self._prepared = seq_len, packing, pad_id, prepared
    self._vocab_size = vocab_size
    self.num_docs: int = prepared.num_docs
    # From the manifest's token counts or the document offsets: no shard's tokens are read.
    rows_S = [num_packed_rows(n, seq_len) if packing
              else int(windows_per_doc(prepared.doc_starts(i), seq_len).sum())
              for i, n in enumerate(prepared.shard_num_tokens)]
    self._first_row_S1 = np.concatenate([[0], np.cumsum(rows_S)]).astype(np.int64)
    self.num_rows = int(self._first_row_S1[-1])

  @property
  def prepared(self):
    """The prepared split these rows are cut from (preparation.PreparedSplit)."""
    return self._prepared

  @functools.lru_cache(maxsize=None)
  def _window_starts(self, shard: int) -> np.ndarray:
    return window_starts(self._prepared.shard(shard), self.seq_len)

  def _shard_rows(self, shard: int, ids_b: np.ndarray,
                  check: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    split = self._prepared.shard(shard)
    if self.packing:
      tokens, segments = gather_packed_rows(split, ids_b, self.seq_len, self._pad_id)
      starts_b = ids_b * self.seq_len
    else:
      starts_b = self._window_starts(shard)[ids_b]
      tokens, segments = gather_windows(split.tokens_N, starts_b, self.seq_len), None
    if check:
      shard_checks.check_token_ids(tokens, self._vocab_size, self._where(shard),
                                   offsets=lambda row, column: int(starts_b[row]) + column)
    return tokens, segments

  def _where(self, shard: int) -> str:
    named = getattr(self._prepared, "shard_file", None)
    return f"the shard file '{named(shard)}'" if named else f"shard {shard}"

  def rows(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens int32[B, T], segment_ids int32[B, T] or None without packing), in ids order."""
    ids_B = np.asarray(ids_B, np.int64)
    shard_B = np.searchsorted(self._first_row_S1, ids_B, side="right") - 1
    tokens_BxT = np.empty((len(ids_B), self.seq_len), np.int32)
    segments_BxT = np.empty((len(ids_B), self.seq_len), np.int32) if self.packing else None
    for shard in np.unique(shard_B):
      here = np.flatnonzero(shard_B == shard)
      tokens, segments = self._shard_rows(int(shard), ids_B[here] - self._first_row_S1[shard])
      tokens_BxT[here] = tokens
      if segments_BxT is not None:
        segments_BxT[here] = segments
    # One check for the whole batch; only a bad one is gone through shard by shard, to name
    # the shard file and the position of the first bad id.
    if self._vocab_size is not None and not shard_checks.ids_in_range(tokens_BxT,
                                                                      self._vocab_size):
      for shard in np.unique(shard_B):
        self._shard_rows(int(shard), ids_B[shard_B == shard] - self._first_row_S1[shard],
                         check=True)
    return tokens_BxT, segments_BxT

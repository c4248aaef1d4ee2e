"""From a tokenized split to rows of exactly T tokens: windows (the paper's way) or packing.

A tokenized split is one flat token array: every document's ids followed by one eod id,

    tokens_N = [d0 d0 d0 eod d1 d1 eod d2 ... eod],  doc_starts_D1 = [0, 4, 7, ..., N]

(doc i is tokens_N[doc_starts[i] : doc_starts[i+1] - 1], its eod at doc_starts[i+1] - 1).

* Windows (default): each document is cut into windows of exactly T tokens and its short tail
  is dropped, as the reference implementation does; the eod never enters a window. Documents
  shorter than T give nothing.
* Packing: the whole eod-joined stream is cut into rows of T, the last row padded with pad
  ids. `segment_ids` number the documents within a row 1, 2, 3, ... (restarting in each row;
  a document cut by a row boundary continues as segment 1 of the next row); 0 marks padding.

A row is named by an integer id (the window number, or the packed row number), so a shuffle is
a permutation of ids and a batch is a gather, which makes batches cheap and resumable.
"""
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """A split as one flat array (see the module docstring); arrays may be memory-mapped."""
  tokens_N: np.ndarray       # uint16 or int32 ids, documents joined by eod
  doc_starts_D1: np.ndarray  # int64, D + 1 offsets into tokens_N

  @property
  def num_docs(self) -> int:
    return len(self.doc_starts_D1) - 1


def join_documents(docs: list[np.ndarray], eod_id: int, vocab_size: int) -> TokenizedSplit:
  """Concatenates tokenized documents, each followed by `eod_id`; empty documents are dropped."""
  lengths_D = np.array([len(d) for d in docs], dtype=np.int64)
  flat_M = np.concatenate(docs) if docs else np.zeros(0, np.int32)
  return join_flat(flat_M, lengths_D, eod_id, vocab_size)


def join_flat(flat_M: np.ndarray, lengths_D: np.ndarray, eod_id: int,
              vocab_size: int) -> TokenizedSplit:
  """`join_documents` of documents given as one flat id array and their lengths."""
  lengths_D = lengths_D[lengths_D > 0]
  # uint16 when every id fits: halves memory and the shards.
  dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
  tokens_N = np.full(len(flat_M) + len(lengths_D), eod_id, dtype)
  doc_starts_D1 = np.concatenate([[0], np.cumsum(lengths_D + 1)]).astype(np.int64)
  # Token j of the flat array lands after the eods of the documents before it.
  doc_of_M = np.repeat(np.arange(len(lengths_D)), lengths_D)
  tokens_N[np.arange(len(flat_M)) + doc_of_M] = flat_M
  return TokenizedSplit(tokens_N, doc_starts_D1)


def concat_splits(parts: list[TokenizedSplit]) -> TokenizedSplit:
  """One split from consecutive chunks (tokenization runs chunk by chunk)."""
  if not parts:
    return TokenizedSplit(np.zeros(0, np.uint16), np.zeros(1, np.int64))
  shifts = np.cumsum([0] + [len(p.tokens_N) for p in parts[:-1]])
  doc_starts_D1 = np.concatenate(
      [[0]] + [p.doc_starts_D1[1:] + shift for p, shift in zip(parts, shifts)])
  return TokenizedSplit(np.concatenate([p.tokens_N for p in parts]),
                        doc_starts_D1.astype(np.int64))


# ------------------------------------------------------------------------------------------
# Windows of exactly T tokens inside each document.
# ------------------------------------------------------------------------------------------
def windows_per_doc(doc_starts_D1: np.ndarray, seq_len: int) -> np.ndarray:
  """int64[D]: how many full windows of `seq_len` tokens each document holds (eod excluded)."""
  return (np.diff(doc_starts_D1) - 1) // seq_len


def window_starts(split: TokenizedSplit, seq_len: int) -> np.ndarray:
  """int64[W]: the start of every full window of `seq_len` tokens, document by document."""
  windows_D = windows_per_doc(split.doc_starts_D1, seq_len)
  num_windows = int(windows_D.sum())
  first_window_D = np.cumsum(windows_D) - windows_D
  # Window w of doc d starts at doc_start[d] + T * (w - first_window[d]).
  doc_of_window_W = np.repeat(np.arange(len(windows_D)), windows_D)
  offset_in_doc_W = np.arange(num_windows) - first_window_D[doc_of_window_W]
  return split.doc_starts_D1[:-1][doc_of_window_W] + seq_len * offset_in_doc_W


def gather_windows(tokens_N: np.ndarray, starts_B: np.ndarray, seq_len: int) -> np.ndarray:
  """int32[B, T]: the windows starting at `starts_B`."""
  return tokens_N[starts_B[:, None] + np.arange(seq_len)].astype(np.int32)


# ------------------------------------------------------------------------------------------
# Packing: the eod-joined stream in rows of T.
# ------------------------------------------------------------------------------------------
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

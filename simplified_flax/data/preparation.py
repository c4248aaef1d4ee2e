"""Tokenize a split once into shards (`shards.py`): worker processes, progress, resume.

The parent reads the split's documents in order and hands every S = shard_docs of them to a
worker process, which tokenizes them and writes shard i (documents iS .. (i+1)S-1). A killed
run keeps its finished shards; the next starts reading at the first missing one (a tfds split
is sliced there, not re-read). Progress with an ETA goes to stderr.
"""
import concurrent.futures
import itertools
import multiprocessing
import shlex
import sys
import time

from absl import logging
from etils import epath

from simplified_flax.data import sequences
from simplified_flax.data import shards
from simplified_flax.data.errors import DataError
from simplified_flax.data.shards import Address, PreparedSplit
from simplified_flax.data.tokenizers import Tokenizer


def _tokenize_shard(directory: str, index: int, texts: list[str], tokenizer: Tokenizer) -> int:
  """Worker: writes shard `index`; returns its token count."""
  split = sequences.join_documents(*tokenizer.encode_flat(texts), tokenizer.eod_id,
                                   tokenizer.vocab_size)
  shards.write_shard(epath.Path(directory), index, split)
  return len(split.tokens_N)


class _Progress:
  """One status line on stderr every 2 s at most (rewritten in place on a terminal)."""

  def __init__(self, label: str, total_docs: int | None, done_docs: int):
    self._label, self._total, self._first, self._printed = label, total_docs, done_docs, None
    self.docs, self.tokens, self._start = done_docs, 0, time.perf_counter()
    self._last = self._start

  def update(self, docs: int, tokens: int, final: bool = False) -> None:
    self.docs, self.tokens, now = self.docs + docs, self.tokens + tokens, time.perf_counter()
    if (not final and now - self._last < 2.0) or self.docs == self._printed:
      return
    self._last, self._printed = now, self.docs
    rate = (self.docs - self._first) / max(now - self._start, 1e-9)
    line = f"prepare {self._label}: {self.docs:,} documents"
    if self._total:
      eta = time.gmtime(max(self._total - self.docs, 0) / rate) if rate > 0 else None
      line += (f" of {self._total:,} ({100 * self.docs / self._total:.0f}%), ETA "
               f"{time.strftime('%H:%M:%S', eta) if eta else '?'}")
    tty = sys.stderr.isatty()
    print(("\r" if tty else "") + line + f", {rate:,.0f} docs/s, {self.tokens:,} tokens this run",
          end="\n" if final or not tty else "", file=sys.stderr, flush=True)


def prepare_split(corpus, split: str, tokenizer: Tokenizer, root: str, *, shard_docs: int,
                  workers: int = 1, max_bytes: int | None = None) -> PreparedSplit:
  """The prepared `split` at `root`, tokenized now where shards are missing (see module doc)
  by `workers` processes (<= 1: this one). A split of more than `max_bytes` on disk is an
  error that prints the prepare command instead."""
  if shard_docs < 1:
    raise DataError(f"data.shard_docs is {shard_docs}; it must be at least 1.")
  address = Address(corpus.identity, split, tokenizer.fingerprint, shard_docs)
  directory = address.directory(root)
  prepared = PreparedSplit.open(root, address)
  if prepared is not None:
    logging.info("Reading prepared %s/%s from %s.", corpus.identity, split, directory)
    return prepared
  size = corpus.split_num_bytes(split) if max_bytes is not None else None
  if size is not None and size > max_bytes:  # the command with this run's --config flags
    flags = [a for a in sys.argv[1:] if a.startswith("--config")]
    command = shlex.join(["python", "-m", "simplified_flax.prepare",
                          *(flags or ["--config=configs/<your variant>.py"])])
    raise DataError(f"The split '{split}' of '{corpus.identity}' ({size / 2**30:.1f} GiB) is not "
                    f"prepared in '{root}'. Tokenize it once, with worker processes (resumable):"
                    f"  {command}")
  logging.info("Preparing %s/%s in %s (once).", corpus.identity, split, root)
  done = shards.finished_shards(directory)
  progress = _Progress(f"{corpus.identity} {split}", corpus.num_documents(split),
                       done * shard_docs)
  texts = corpus.documents(split, start=done * shard_docs)
  chunks = enumerate(iter(lambda: list(itertools.islice(texts, shard_docs)), []), start=done)
  if workers <= 1:
    for index, chunk in chunks:
      progress.update(len(chunk), _tokenize_shard(str(directory), index, chunk, tokenizer))
      done = index + 1
  else:
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
      pending = []  # (index, size, future), at most workers + 1 in flight: bounded memory
      for index, chunk in itertools.chain(chunks, [(None, None)]):
        if index is not None:
          pending.append((index, len(chunk),
                          pool.submit(_tokenize_shard, str(directory), index, chunk, tokenizer)))
        while pending and (index is None or len(pending) > workers):
          finished_index, size, future = pending.pop(0)
          progress.update(size, future.result())
          done = finished_index + 1
  progress.update(0, 0, final=True)
  if done == 0:
    raise DataError(f"The split '{split}' of dataset '{corpus.identity}' is empty (no document "
                    f"with text under feature '{corpus.text_key}'). Check data.name, data.text_key "
                    "and the split names.")
  shards.write_manifest(directory, address, done)
  return PreparedSplit.open(root, address)

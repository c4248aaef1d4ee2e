"""Prepared token shards: a split tokenized once (worker processes, resumable), read back.

    <root>/<dataset>.<split>.<key>/     root: data.cache_dir, local or remote (etils.epath)
        tokens-00000.npy   uint16/int32[N_i]  documents iS .. (i+1)S-1 of the split, eod-joined
        docs-00000.npy     int64[D_i + 1]     document start offsets into tokens-00000.npy
        manifest.json      written last: the address fields, every shard's sizes and the
                           crc32 of its two files (`shard_checks.py`)

`key` hashes the corpus identity, split, tokenizer fingerprint, S and the format: a split is
addressed by its source and its name (a second source, `data.eval_name`, is a corpus with its
own identity, so two sources' `train` splits are two directories). Worker
processes tokenize S documents each into one shard; every file is written under a temporary
name and renamed, a shard is finished once its docs file (written last) exists, and only the
manifest makes the split usable: a killed preparation never looks complete, and the next one
resumes at the first missing shard. Local shards are memory-mapped, remote ones read whole.
A shard is checked against its manifest's checksums once, when it is first opened (a manifest
from before checksums: not checked); `repair_shard` re-tokenizes one damaged shard in place.
"""
import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import time

from absl import logging
from etils import epath
import numpy as np

from simplified_flax.data import shard_checks
from simplified_flax.data.errors import DataError
from simplified_flax.data.sequences import TokenizedSplit, join_documents
from simplified_flax.data.tokenizers import Tokenizer
from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.storage import is_remote, write_atomically

FORMAT = 1
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class Address:
  """What a prepared split is made of; `directory(root)` is where it lives."""
  identity: str      # the corpus
  split: str
  tokenizer: str     # the tokenizer's fingerprint
  shard_docs: int    # documents per shard

  def as_dict(self) -> dict:
    return {"format": FORMAT, **dataclasses.asdict(self)}

  def directory(self, root: str) -> epath.Path:
    key = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
    slugs = [re.sub(r"[^\w.-]+", "_", s).strip("_") or "_" for s in (self.identity, self.split)]
    return epath.Path(root) / f"{slugs[0]}.{slugs[1]}.{key}"


def _shard_paths(directory: epath.Path, index: int) -> tuple[epath.Path, epath.Path]:
  return directory / f"tokens-{index:05d}.npy", directory / f"docs-{index:05d}.npy"


def _load(path: epath.Path, mmap: bool = False, crc32: int | None = None) -> np.ndarray:
  """The array in `path` (memory-mapped when `mmap` and local), after checking that its bytes
  have the checksum `crc32` (None: not checked)."""
  if mmap and not is_remote(path):
    if crc32 is not None:
      shard_checks.verify_checksum(path, shard_checks.crc32_of_file(path), crc32)
    return np.load(os.fspath(path), mmap_mode="r")
  data = storage.read_bytes(path)
  if crc32 is not None:
    shard_checks.verify_checksum(path, shard_checks.crc32_of_bytes(data), crc32)
  return np.load(io.BytesIO(data))


def shard_index_of(path) -> int | None:
  """The index of the shard whose tokens or docs file is `path`, else None."""
  match = re.fullmatch(r"(?:tokens|docs)-(\d{5})\.npy", epath.Path(path).name)
  return int(match.group(1)) if match else None


def _npy_bytes(array: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  np.save(buffer, array)
  return buffer.getvalue()


def write_shard(directory: epath.Path, index: int, split: TokenizedSplit) -> list[int]:
  """Writes shard `index`; returns the crc32 of its [tokens, docs] files (no read back)."""
  directory.mkdir(parents=True, exist_ok=True)
  tokens_path, docs_path = _shard_paths(directory, index)
  files = [_npy_bytes(np.asarray(split.tokens_N)),
           _npy_bytes(np.asarray(split.doc_starts_D1, np.int64))]
  write_atomically(tokens_path, lambda f: f.write(files[0]))
  # Last: the docs file marks the shard finished.
  write_atomically(docs_path, lambda f: f.write(files[1]))
  return [shard_checks.crc32_of_bytes(data) for data in files]


def write_manifest(directory: epath.Path, address: Address, num_shards: int,
                   crc32: dict[int, list[int]] | None = None) -> None:
  """Records every shard's sizes and checksums and makes the split usable. `crc32` holds the
  checksums of the shards written by this process; the others' files are read to get theirs
  (shards kept from a killed preparation)."""
  crc32 = crc32 or {}
  docs = [_load(_shard_paths(directory, index)[1]) for index in range(num_shards)]
  manifest = {**address.as_dict(), "num_shards": num_shards,
              "shard_num_docs": [len(d) - 1 for d in docs],
              "shard_num_tokens": [int(d[-1]) for d in docs],
              "shard_crc32": [crc32.get(i) or [shard_checks.crc32_of_file(p)
                                               for p in _shard_paths(directory, i)]
                              for i in range(num_shards)]}
  write_atomically(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


class PreparedSplit:
  """A finished split: its shards as TokenizedSplits (memory-mapped when local)."""

  def __init__(self, directory: epath.Path, manifest: dict):
    self.directory = directory
    self.num_shards: int = manifest["num_shards"]
    self.shard_num_tokens = np.asarray(manifest["shard_num_tokens"], np.int64)
    self.num_docs = int(sum(manifest["shard_num_docs"]))
    self.shard_crc32: list | None = manifest.get("shard_crc32")  # None: an older manifest

  @classmethod
  def open(cls, root: str, address: Address) -> "PreparedSplit | None":
    """The prepared split at `address`, or None when it is not (completely) prepared."""
    directory = address.directory(root)
    manifest_path = directory / MANIFEST
    if not storage.exists(manifest_path):
      return None
    def corrupt(reason):
      return DataError(f"The shard manifest '{manifest_path}' is corrupt ({reason}). Delete "
                       f"'{directory}' and prepare the split again.")
    try:
      manifest = json.loads(storage.read_text(manifest_path))
    except json.JSONDecodeError as e:
      raise corrupt(e.msg) from None
    except UnicodeDecodeError:
      raise corrupt("not UTF-8 text") from None
    if not isinstance(manifest, dict):
      raise corrupt(f"a JSON {type(manifest).__name__}, not an object")
    if {k: manifest.get(k) for k in address.as_dict()} != address.as_dict():
      raise DataError(f"The shard manifest '{manifest_path}' describes other data than its "
                      f"address. Delete '{directory}' and prepare the split again.")
    try:
      return cls(directory, manifest)
    except (KeyError, TypeError, ValueError) as e:
      raise corrupt(f"bad or missing field: {e}") from None

  def shard_file(self, index: int) -> epath.Path:
    """The tokens file of shard `index` (what error messages name)."""
    return _shard_paths(self.directory, index)[0]

  def _read(self, index: int, tokens: bool) -> np.ndarray:
    """Shard `index`'s tokens or docs, checked against the manifest's checksum (once: the
    callers cache it)."""
    path = _shard_paths(self.directory, index)[0 if tokens else 1]
    crc32 = self.shard_crc32[index][0 if tokens else 1] if self.shard_crc32 else None
    try:
      return _load(path, mmap=tokens, crc32=crc32)
    except DataError:
      raise
    except (OSError, ValueError) as e:
      raise DataError(f"The shard file '{path}' cannot be read ({e}). Rebuild just this shard:  "
                      f"{shard_checks.repair_command(path)}") from None

  @functools.lru_cache(maxsize=None)
  def doc_starts(self, index: int) -> np.ndarray:
    """int64[D_i + 1] of shard `index`, read without its tokens."""
    return self._read(index, tokens=False)

  @functools.lru_cache(maxsize=None)
  def shard(self, index: int) -> TokenizedSplit:
    split = TokenizedSplit(self._read(index, tokens=True), self.doc_starts(index))
    if len(split.tokens_N) != self.shard_num_tokens[index]:
      raise DataError(f"The shard file '{self.shard_file(index)}' has {len(split.tokens_N)} "
                      f"tokens, its manifest {self.shard_num_tokens[index]}. Rebuild just this "
                      f"shard:  {shard_checks.repair_command(self.shard_file(index))}")
    return split


def _tokenize_shard(directory: str, index: int, texts: list[str],
                    tokenizer: Tokenizer) -> tuple[int, list[int]]:
  """Worker: writes shard `index`; returns its token count and its files' crc32."""
  split = join_documents(*tokenizer.encode_flat(texts), tokenizer.eod_id, tokenizer.vocab_size)
  return len(split.tokens_N), write_shard(epath.Path(directory), index, split)


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
    raise DataError(f"The split '{split}' of '{corpus.identity}' ({size / 2**30:.1f} GiB) is not "
                    f"prepared in '{root}'. Tokenize it once, with worker processes (resumable):"
                    f"  {shard_checks.prepare_command()}")
  logging.info("Preparing %s/%s in %s (once).", corpus.identity, split, root)
  done, crc32 = 0, {}
  while storage.exists(_shard_paths(directory, done)[1]):  # finished shards: resume after them
    done += 1
  progress = _Progress(f"{corpus.identity} {split}", corpus.num_documents(split),
                       done * shard_docs)
  texts = corpus.documents(split, start=done * shard_docs)
  chunks = enumerate(iter(lambda: list(itertools.islice(texts, shard_docs)), []), start=done)
  if workers <= 1:
    for index, chunk in chunks:
      tokens, crc32[index] = _tokenize_shard(str(directory), index, chunk, tokenizer)
      progress.update(len(chunk), tokens)
      done = index + 1
  else:
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with concurrent.futures.ProcessPoolExecutor(   # workers retry as this process does
        workers, mp_context=context, initializer=retries.configure,
        initargs=(retries.budget_s(), is_remote(root))) as pool:
      pending = []  # (index, size, future), at most workers + 1 in flight: bounded memory
      for index, chunk in itertools.chain(chunks, [(None, None)]):
        if index is not None:
          pending.append((index, len(chunk),
                          pool.submit(_tokenize_shard, str(directory), index, chunk, tokenizer)))
        while pending and (index is None or len(pending) > workers):
          finished_index, size, future = pending.pop(0)
          tokens, crc32[finished_index] = future.result()
          progress.update(size, tokens)
          done = finished_index + 1
  progress.update(0, 0, final=True)
  if done == 0:
    raise DataError(f"The split '{split}' of dataset '{corpus.identity}' is empty (no document "
                    f"with text under feature '{corpus.text_key}'). Check data.name, data.text_key "
                    "and the split names.")
  write_manifest(directory, address, done, crc32)
  return PreparedSplit.open(root, address)


def repair_shard(corpus, split: str, tokenizer: Tokenizer, root: str, *, shard_docs: int,
                 index: int) -> PreparedSplit:
  """Re-tokenizes only the documents of shard `index` of a prepared split, in place, and checks
  the result against the manifest (its sizes; its checksums where recorded; an older manifest
  is rewritten with checksums). A mismatch means the corpus or tokenizer changed since: a
  DataError asking to prepare the split again."""
  address = Address(corpus.identity, split, tokenizer.fingerprint, shard_docs)
  prepared = PreparedSplit.open(root, address)
  if prepared is None or not 0 <= index < prepared.num_shards:
    raise DataError(f"'{address.directory(root)}' holds no prepared shard {index} of '{split}' "
                    f"to repair; prepare the split instead:  {shard_checks.prepare_command()}")
  texts = list(itertools.islice(corpus.documents(split, start=index * shard_docs), shard_docs))
  tokens, crc32 = _tokenize_shard(str(prepared.directory), index, texts, tokenizer)
  recorded = prepared.shard_crc32[index] if prepared.shard_crc32 else crc32
  if tokens != prepared.shard_num_tokens[index] or crc32 != list(recorded):
    raise DataError(f"Shard {index} of '{prepared.directory}' re-tokenized differs from its "
                    "manifest: the corpus or the tokenizer changed since it was prepared. Delete "
                    "the directory and prepare the split again.")
  if prepared.shard_crc32 is None:
    write_manifest(prepared.directory, address, prepared.num_shards)
  return PreparedSplit.open(root, address)

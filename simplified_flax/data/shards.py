"""Prepared token shards: where they live, how one is written, how a split is read back.

    <root>/<dataset>.<split>.<key>/     root: data.cache_dir, local or remote (etils.epath)
        tokens-00000.npy   uint16/int32[N_i]  documents iS .. (i+1)S-1 of the split, eod-joined
        docs-00000.npy     int64[D_i + 1]     document start offsets into tokens-00000.npy
        manifest.json      written last: the address fields and every shard's sizes

`key` hashes the corpus identity, split, tokenizer fingerprint, S and the format, so changed
data never reuses old tokens. Files are written under a temporary name and renamed; a shard
is finished once its docs file (written last) exists, and only the manifest makes the split
usable: a killed preparation keeps its finished shards and never looks complete. Local shards
are memory-mapped; a remote shard is read whole when a batch first needs it.
"""
import dataclasses
import functools
import hashlib
import io
import json
import os
import re

from etils import epath
import numpy as np

from simplified_flax.data.errors import DataError
from simplified_flax.data.sequences import TokenizedSplit
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


def _load(path: epath.Path, mmap: bool = False) -> np.ndarray:
  if mmap and not is_remote(path):
    return np.load(os.fspath(path), mmap_mode="r")
  return np.load(io.BytesIO(path.read_bytes()))


def write_shard(directory: epath.Path, index: int, split: TokenizedSplit) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  tokens_path, docs_path = _shard_paths(directory, index)
  write_atomically(tokens_path, lambda f: np.save(f, np.asarray(split.tokens_N)))
  # Last: the docs file marks the shard finished.
  write_atomically(docs_path, lambda f: np.save(f, np.asarray(split.doc_starts_D1, np.int64)))


def finished_shards(directory: epath.Path) -> int:
  """How many shards 0, 1, 2, ... are finished (a preparation resumes after them)."""
  count = 0
  while _shard_paths(directory, count)[1].exists():
    count += 1
  return count


def write_manifest(directory: epath.Path, address: Address, num_shards: int) -> None:
  """Records every shard's sizes and makes the split usable."""
  docs = [_load(_shard_paths(directory, index)[1]) for index in range(num_shards)]
  manifest = {**address.as_dict(), "num_shards": num_shards,
              "shard_num_docs": [len(d) - 1 for d in docs],
              "shard_num_tokens": [int(d[-1]) for d in docs]}
  write_atomically(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


class PreparedSplit:
  """A finished split: its shards as TokenizedSplits (memory-mapped when local)."""

  def __init__(self, directory: epath.Path, manifest: dict):
    self.directory = directory
    self.num_shards: int = manifest["num_shards"]
    self.shard_num_tokens = np.asarray(manifest["shard_num_tokens"], np.int64)
    self.num_docs = int(sum(manifest["shard_num_docs"]))

  @classmethod
  def open(cls, root: str, address: Address) -> "PreparedSplit | None":
    """The prepared split at `address`, or None when it is not (completely) prepared."""
    directory = address.directory(root)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
      return None
    try:
      manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
      raise DataError(f"The shard manifest '{manifest_path}' is corrupt ({e.msg}). Delete "
                      f"'{directory}' and prepare the split again.") from None
    if {k: manifest.get(k) for k in address.as_dict()} != address.as_dict():
      raise DataError(f"The shard manifest '{manifest_path}' describes other data than its "
                      f"address. Delete '{directory}' and prepare the split again.")
    return cls(directory, manifest)

  def _read(self, index: int, tokens: bool) -> np.ndarray:
    try:
      return _load(_shard_paths(self.directory, index)[0 if tokens else 1], mmap=tokens)
    except (OSError, ValueError) as e:
      raise DataError(f"Shard {index} of '{self.directory}' cannot be read ({e}). Delete the "
                      "directory and prepare the split again.") from None

  @functools.lru_cache(maxsize=None)
  def doc_starts(self, index: int) -> np.ndarray:
    """int64[D_i + 1] of shard `index`, read without its tokens."""
    return self._read(index, tokens=False)

  @functools.lru_cache(maxsize=None)
  def shard(self, index: int) -> TokenizedSplit:
    split = TokenizedSplit(self._read(index, tokens=True), self.doc_starts(index))
    if len(split.tokens_N) != self.shard_num_tokens[index]:
      raise DataError(f"Shard {index} of '{self.directory}' has {len(split.tokens_N)} tokens, "
                      f"its manifest {self.shard_num_tokens[index]}. Delete the directory and "
                      "prepare the split again.")
    return split

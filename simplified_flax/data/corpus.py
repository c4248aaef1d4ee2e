"""`config.data.name` -> a corpus: documents as plain strings, split by split.

    corpus = open_corpus(config.data)
    corpus.identity                      # names the data in shard addresses and iterator states
    for text in corpus.documents("train", start=0): ...

"python_code" (local Python source, default the interpreter's stdlib) and "text_files" (local
plain-text / JSON-lines files) are `LocalCorpus`es, read straight from their files
(`local_files.py`); any other name is a tensorflow-datasets name with an optional config and
version ("lm1b", "c4/en:3.0.1"), read by `tfds_corpus.py`, the one module importing TensorFlow.
"""
import dataclasses
import functools
import hashlib
import os
from typing import Iterator, Sequence

from simplified_flax.data import local_files
from simplified_flax.data.errors import DataError

_SPLITS = ("train", "validation")
_FORMAT = "local-v2"  # bump when the document rules of local_files.py change


def parse_list(value: str | Sequence[str] | None) -> list[str]:
  """A config list: a comma-separated string or a sequence; None or '' is empty."""
  items = (value.split(",") if isinstance(value, str) else list(value)) if value else []
  return [item.strip() for item in items if item.strip()]


def open_corpus(data_config):
  """The corpus `data_config.name` names (a LocalCorpus or TfdsCorpus), both splits checked."""
  name = data_config.name
  if name == "python_code":
    corpus = LocalCorpus.python_code(parse_list(data_config.roots))
  elif name == "text_files":
    corpus = LocalCorpus.text_files(parse_list(data_config.paths), data_config.json_key)
  else:
    from simplified_flax.data.tfds_corpus import TfdsCorpus  # pylint: disable=g-import-not-at-top
    corpus = TfdsCorpus.open(name, data_config.text_key, data_config.tfds_data_dir)
  for split in (data_config.train_split, data_config.eval_split):
    corpus.check_split(split)
  return corpus


@dataclasses.dataclass(frozen=True)
class LocalCorpus:
  """The documents of local files, with the splits "train" and "validation".

  `identity` hashes the file list with each file's size and modification time: editing,
  adding or removing a file makes a new identity (and new shards), the same files are
  prepared once. Construction only lists and stats; files are read when documents are asked.
  """
  name: str                  # "python_code" or "text_files"
  roots: tuple[str, ...]     # python_code: absolute roots
  files: tuple[str, ...]     # text_files: absolute, sorted files
  json_key: str
  identity: str
  text_key: str = "content"

  @classmethod
  def python_code(cls, roots: Sequence[str] | None) -> "LocalCorpus":
    stdlib = (local_files.stdlib_root(),)
    roots = tuple(sorted({os.path.realpath(os.path.expanduser(r)) for r in roots or ()})) or stdlib
    stats = [_stat_line(os.path.join(root, rel))
             for root in roots for rel in local_files.walk_python_files(root)]
    label = "stdlib" if roots == stdlib else "roots"
    return cls("python_code", roots, (), "", f"python_code/{label}-{_digest(roots, stats)}")

  @classmethod
  def text_files(cls, patterns: Sequence[str], json_key: str) -> "LocalCorpus":
    if not patterns:
      raise DataError("data.name is 'text_files' but data.paths is empty: give comma-separated "
                      "files or globs (plain text, or .jsonl with one JSON object per line).")
    files = tuple(local_files.expand_paths(patterns))
    stats = [_stat_line(f) for f in files]
    return cls("text_files", (), files, json_key,
               f"text_files/files-{_digest(files, stats, [json_key])}")

  @functools.cached_property
  def _splits(self) -> dict[str, list[local_files.DocGroup]]:
    if self.name == "python_code":
      return local_files.assign_splits(local_files.python_documents(self.roots))
    return local_files.assign_splits(local_files.text_documents(self.files, self.json_key))

  def check_split(self, split: str) -> None:
    if split not in _SPLITS:
      raise DataError(f"Corpus '{self.identity}' has no split '{split}'; it has "
                      f"{list(_SPLITS)}. Set data.train_split / data.eval_split.")

  def _docs(self, split: str) -> list[local_files.DocGroup]:
    self.check_split(split)
    return self._splits[split]

  def num_documents(self, split: str) -> int:
    return sum(group.num_docs for group in self._docs(split))

  def split_num_bytes(self, split: str) -> int:
    """The bytes of the files that hold the split (a JSON-lines file counts whole)."""
    return sum(os.path.getsize(p) for p in {d.abs_path for d in self._docs(split)})

  def documents(self, split: str, start: int = 0) -> Iterator[str]:
    """The texts of `split` from document `start` on, in a fixed order."""
    return local_files.read_documents(self._docs(split), self.json_key, start)


def _stat_line(path: str) -> str:
  stat = os.stat(path)
  return f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}"


def _digest(*parts: Sequence[str]) -> str:
  joined = "\0".join([_FORMAT] + [item for part in parts for item in part])
  return hashlib.sha256(joined.encode("utf-8")).hexdigest()[:12]

"""Local corpora read straight from files: `python_code` and `text_files` (no TensorFlow).

    corpus = LocalCorpus.python_code(["/src/a"])       # or None: the interpreter's stdlib
    corpus = LocalCorpus.text_files(["docs/*.jsonl"], json_key="text")
    corpus.identity                                     # "text_files/files-3f9a0c1b2d4e"
    for text in corpus.documents("train"): ...          # files sorted, lines in order

`identity` hashes the file list with each file's size and modification time, so editing,
adding or removing a file gives a new identity (and so new prepared shards), while the same
files are prepared once. Only listing and `stat` happen at construction; files are read when
documents are asked for (see `local_files.py` for the split rule and the validation).
"""
import dataclasses
import functools
import hashlib
import os
from typing import Iterator, Sequence

from simplified_flax.data import local_files
from simplified_flax.data.errors import DataError
from simplified_flax.data.local_files import DocGroup

_SPLITS = ("train", "validation")
_FORMAT = "local-v2"  # bump when the document rules of local_files.py change


@dataclasses.dataclass(frozen=True)
class LocalCorpus:
  """Documents of local files; see the module docstring."""
  name: str                  # "python_code" or "text_files"
  roots: tuple[str, ...]     # python_code: absolute roots
  files: tuple[str, ...]     # text_files: absolute, sorted files
  json_key: str
  identity: str
  text_key: str = "content"

  @classmethod
  def python_code(cls, roots: Sequence[str] | None) -> "LocalCorpus":
    if roots:
      roots = tuple(sorted({os.path.realpath(os.path.expanduser(r)) for r in roots}))
    else:
      roots = (local_files.stdlib_root(),)
    stats = [_stat_line(os.path.join(root, rel))
             for root in roots for rel in local_files.walk_python_files(root)]
    label = "stdlib" if roots == (local_files.stdlib_root(),) else "roots"
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
  def _splits(self) -> dict[str, list[DocGroup]]:
    if self.name == "python_code":
      docs = local_files.python_documents(self.roots)
    else:
      docs = local_files.text_documents(self.files, self.json_key)
    return local_files.assign_splits(docs)

  def check_split(self, split: str) -> None:
    if split not in _SPLITS:
      raise DataError(f"Corpus '{self.identity}' has no split '{split}'; it has "
                      f"{list(_SPLITS)}. Set data.train_split / data.eval_split.")

  def _docs(self, split: str) -> list[DocGroup]:
    self.check_split(split)
    return self._splits[split]

  def num_documents(self, split: str) -> int:
    return sum(group.num_docs for group in self._docs(split))

  def split_num_bytes(self, split: str) -> int | None:
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

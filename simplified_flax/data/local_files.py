"""The documents of a local corpus: found, validated and split (file-system code only).

`python_code`: one document per `*.py` file under some roots (default: the interpreter's
standard library). `text_files`: one per file, or per line of a `.jsonl` file (the text in its
`json_key` field). A document goes to validation when a stable hash of its root-relative name
(for a JSON line, mixed with the line number) falls in the first VALIDATION_PERCENT of
buckets, so the split depends on nothing else. Documents are kept per file (`DocGroup`): a
million-line file costs arrays, not objects.
"""
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import sysconfig
from typing import Iterator, Sequence

from absl import logging
import numpy as np

from simplified_flax.data.errors import DataError
from simplified_flax.data.index_shuffle import mix64

VALIDATION_PERCENT = 5
# Installed third-party packages and caches are not part of a source tree's own code.
PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git", ".hg",
                         ".svn", ".tox", ".venv", "node_modules"})
_JSONL_BATCH = 10_000  # lines parsed by one json.loads call


@dataclasses.dataclass(frozen=True)
class DocGroup:
  """The documents of one file: the whole file (`lines` None) or some of its JSON lines."""
  name: str        # stable, root-relative name: hashed for the split
  abs_path: str
  lines: tuple[int, ...] | None = None  # 1-based line numbers, ascending

  @property
  def num_docs(self) -> int:
    return 1 if self.lines is None else len(self.lines)

  def buckets(self) -> np.ndarray:
    """int64[num_docs]: each document's hash bucket in [0, 10000)."""
    name_hash = int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:8], "big")
    if self.lines is None:
      return np.array([name_hash % 10_000], np.int64)
    # One SHA-256 per file, then a vectorised mix per line: a million lines cost ~0.1 s.
    lines_U64 = np.asarray(self.lines, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (mix64(np.uint64(name_hash) + lines_U64) % np.uint64(10_000)).astype(np.int64)


def stdlib_root() -> str:
  """The running interpreter's standard library: ~30 MB of real Python on every machine."""
  return sysconfig.get_paths()["stdlib"]


def assign_splits(groups: Sequence[DocGroup]) -> dict[str, list[DocGroup]]:
  """Documents by split (see the module docstring); when the hash leaves validation empty, it
  gets the document with the smallest bucket, so tiny corpora still have an eval split."""
  total = sum(g.num_docs for g in groups)
  if total < 2:
    raise DataError(f"The corpus has {total} usable document(s); 2 or more are needed to hold "
                    "one out for validation. Add files (or, for text_files, use a JSON-lines "
                    "file with one document per line).")
  buckets = [g.buckets() for g in groups]
  held_out = [b < VALIDATION_PERCENT * 100 for b in buckets]
  if not any(h.any() for h in held_out):
    smallest = min(range(len(groups)), key=lambda i: (buckets[i].min(), groups[i].name))
    held_out[smallest][np.argmin(buckets[smallest])] = True
  splits = {"train": [], "validation": []}
  for group, held in zip(groups, held_out):
    for split, keep in (("train", ~held), ("validation", held)):
      if keep.any():
        lines = None if group.lines is None else tuple(np.asarray(group.lines)[keep].tolist())
        splits[split].append(dataclasses.replace(group, lines=lines))
  return splits


def read_text(path: str) -> str | None:
  """The text of the file `path`, or None when it is not UTF-8 (a BOM is dropped)."""
  try:
    return pathlib.Path(path).read_bytes().decode("utf-8-sig")
  except UnicodeDecodeError:
    return None


def walk_python_files(root: str) -> list[str]:
  """Sorted root-relative paths of the `*.py` files under `root`, skipping PRUNED_DIRS."""
  if not os.path.isdir(root):
    raise DataError(f"data.roots: '{root}' is not a directory. Give existing directories of "
                    "Python source (comma-separated), or leave data.roots unset for the "
                    "standard library.")
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in PRUNED_DIRS]
    found += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames
              if f.endswith(".py")]
  return sorted(found)


def python_documents(roots: Sequence[str]) -> list[DocGroup]:
  """The usable `*.py` documents under `roots`, in a stable order: empty or non-UTF-8 files are
  skipped and counted; a root that is missing or holds no usable `*.py` file is an error."""
  docs = []
  for root in roots:
    rel_paths = walk_python_files(root)
    not_utf8, empty, docs_before = [], 0, len(docs)
    for rel in rel_paths:
      text = read_text(os.path.join(root, rel))
      if text is None:
        not_utf8.append(rel)
      elif not text:
        empty += 1
      else:  # a root-relative name: the split does not depend on where the root lives
        docs.append(DocGroup(name=rel, abs_path=os.path.join(root, rel)))
    if not_utf8 or empty:
      # The default corpus always skips some (the standard library ships encoding-test modules
      # and empty __init__.py files): a warning there would be on every first run's stderr.
      level = logging.INFO if root == stdlib_root() else logging.WARNING
      logging.log(level, "python_code: under %s skipped %d non-UTF-8 file(s) %s and %d empty "
                  "file(s).", root, len(not_utf8), not_utf8[:3], empty)
    if len(docs) == docs_before:
      raise DataError(f"data.roots: no usable *.py file under '{root}' ({len(rel_paths)} found "
                      f"outside {', '.join(sorted(PRUNED_DIRS))}; {len(not_utf8)} not UTF-8, "
                      f"{empty} empty). Point data.roots at a directory of UTF-8 Python source.")
  return docs


def expand_paths(patterns: Sequence[str]) -> list[str]:
  """Absolute, sorted, de-duplicated files named by `patterns` (files or recursive globs)."""
  files = set()
  for pattern in patterns:
    if set("*?[") & set(pattern):
      matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
      if not matches:
        raise DataError(f"data.paths: the glob '{pattern}' matches no file. Check the pattern "
                        "(use '**' for subdirectories, e.g. 'corpus/**/*.txt').")
      files.update(os.path.abspath(p) for p in matches)
    elif os.path.isdir(pattern):
      raise DataError(f"data.paths: '{pattern}' is a directory; give files or a glob such as "
                      f"'{os.path.join(pattern, '**', '*.txt')}'.")
    elif not os.path.isfile(pattern):
      raise DataError(f"data.paths: '{pattern}' does not exist. Give existing files or globs "
                      "(comma-separated).")
    else:
      files.add(os.path.abspath(pattern))
  return sorted(files)


def text_documents(files: Sequence[str], json_key: str) -> list[DocGroup]:
  """One document per plain file, one per non-empty line of a JSON-lines file."""
  base = os.path.commonpath([os.path.dirname(f) for f in files])
  docs = []
  for path in files:
    rel = os.path.relpath(path, base)
    if path.endswith((".jsonl", ".ndjson")):
      lines = tuple(line for line, _ in iter_jsonl(path, json_key))
      if lines:
        docs.append(DocGroup(name=rel, abs_path=path, lines=lines))
    elif _text_or_raise(path):
      docs.append(DocGroup(name=rel, abs_path=path))
  if not docs:
    raise DataError(f"data.paths: the corpus is empty: the {len(files)} file(s) under '{base}' "
                    "hold no text. Point data.paths at non-empty files.")
  return docs


def _text_or_raise(path: str) -> str:
  text = read_text(path)
  if text is None:
    raise DataError(f"'{path}' is not UTF-8 text. Convert it (e.g. `iconv -t UTF-8`) or leave "
                    "it out of the corpus.")
  return text


def iter_jsonl(path: str, json_key: str) -> Iterator[tuple[int, str]]:
  """(1-based line, text) of every line of `path` whose `json_key` holds non-empty text."""
  numbered = [(n, line) for n, line in enumerate(_text_or_raise(path).splitlines(), start=1)
              if line.strip()]
  for start in range(0, len(numbered), _JSONL_BATCH):
    batch = numbered[start:start + _JSONL_BATCH]
    try:  # one C-speed parse for the whole batch; a bad line is then found line by line
      records = json.loads("[" + ",".join(line for _, line in batch) + "]")
      texts = [r.get(json_key) if isinstance(r, dict) else None for r in records]
      ok = len(records) == len(batch) and all(isinstance(t, str) for t in texts)
    except json.JSONDecodeError:
      ok = False
    if not ok:
      texts = [_jsonl_text(path, n, line, json_key) for n, line in batch]
    yield from ((n, text) for (n, _), text in zip(batch, texts) if text)


def _jsonl_text(path: str, line_no: int, line: str, json_key: str) -> str:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f"data.paths: '{path}' line {line_no} is not JSON ({e.msg}). A JSON-lines "
                    "file holds one JSON object per line.") from None
  if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
    raise DataError(f"data.paths: '{path}' line {line_no} has no string field '{json_key}'. "
                    "Set data.json_key to the field that holds the text.")
  return record[json_key]


def read_documents(groups: Sequence[DocGroup], json_key: str, start: int = 0) -> Iterator[str]:
  """The texts of `groups` in order from document `start` on; files before it are not read
  (they are read again here rather than held in memory since the scan)."""
  for group in groups:
    if start >= group.num_docs:
      start -= group.num_docs
      continue
    if group.lines is None:
      yield _text_or_raise(group.abs_path)
    else:
      wanted = set(group.lines[start:])
      found = 0
      for line_no, text in iter_jsonl(group.abs_path, json_key):
        if line_no in wanted:
          found += 1
          yield text
      if found != len(wanted):
        raise DataError(f"'{group.abs_path}' changed after it was scanned; prepare again.")
    start = 0

"""`config.data.name` -> a corpus: documents as plain strings, split by split.

    corpus = open_corpus(config.data)
    corpus.identity                      # names the data in shard addresses and iterator states
    for text in corpus.documents("train", start=0): ...
    train, evals = open_corpora(config.data)   # the corpora of the train and eval documents

"python_code" and "text_files" are `LocalCorpus`es read straight from their files
(`local_files.py`); any other name is a tensorflow-datasets name ("lm1b", "c4/en:3.0.1"), a
`TfdsCorpus`: only opening one imports TensorFlow. "hf:<hub name | folder | files>" is a
Hugging Face dataset, an `HfCorpus` (`hf_corpus.py`): only opening one imports `datasets`. An unprepared tfds dataset is prepared
(downloaded) when tfds can; a failure names the command to run where there is network.
The train and eval documents are two splits of one corpus, except with an "hf:" name and
`data.eval_name`: then the eval split is of a second corpus, with its own identity (prepared
shards are addressed by corpus identity and split, so two sources may share a split name).
"""
import contextlib
import dataclasses
import difflib
import fcntl
import functools
import hashlib
import os
import re
from typing import Any, Iterator, Sequence

from absl import logging

from simplified_flax.data import local_files
from simplified_flax.data.errors import DataError
from simplified_flax.data.hf_corpus import is_hf, open_hf_corpora
from simplified_flax.storage import is_remote

_SPLITS = ("train", "validation")
_FORMAT = "local-v2"  # bump when the document rules of local_files.py change
_READ_BATCH = 256  # tfds documents per tf.data -> numpy hop (one hop per document is slow)


def parse_list(value: str | Sequence[str] | None) -> list[str]:
  """A config list: a comma-separated string or a sequence; None or '' is empty."""
  items = (value.split(",") if isinstance(value, str) else list(value)) if value else []
  return [item.strip() for item in items if item.strip()]


def open_corpora(data_config) -> tuple:
  """(the corpus of the training documents, the corpus of the eval documents), the split of
  each checked: the corpus `data_config.name` names (a LocalCorpus, HfCorpus or TfdsCorpus)
  twice, or for an "hf:" name with `data.eval_name` an HfCorpus per source."""
  name = data_config.name
  if is_hf(name):
    train, evals = open_hf_corpora(data_config)
  elif name == "python_code":
    train = evals = LocalCorpus.python_code(parse_list(data_config.roots))
  elif name == "text_files":
    train = evals = LocalCorpus.text_files(parse_list(data_config.paths), data_config.json_key)
  else:
    builder = _builder(name, data_config.tfds_data_dir)
    train = evals = TfdsCorpus(builder, _text_key(builder, data_config.text_key),
                               builder.info.full_name)
  train.check_split(data_config.train_split)
  evals.check_split(data_config.eval_split)
  return train, evals


def open_corpus(data_config):
  """The corpus of the training documents (open_corpora's first); unless `data.eval_name`
  names a second source, the eval split is one of its splits too."""
  return open_corpora(data_config)[0]


@dataclasses.dataclass(frozen=True)
class LocalCorpus:
  """The documents of local files in the splits "train" and "validation". `identity` hashes
  the file list with each file's size and mtime, so changed files are new data (new shards).
  Construction only lists and stats; files are read when documents are asked for."""
  name: str                  # "python_code" or "text_files"
  roots: tuple[str, ...]     # python_code: absolute roots
  files: tuple[str, ...]     # text_files: absolute, sorted files
  json_key: str
  identity: str
  text_key: str = "content"

  @classmethod
  def python_code(cls, roots: Sequence[str] | None) -> "LocalCorpus":
    stdlib = (local_files.stdlib_root(),)
    roots = tuple(sorted({os.path.realpath(os.path.expanduser(r)) for r in roots or ()}))
    roots = roots or stdlib
    files = [os.path.join(root, rel)
             for root in roots for rel in local_files.walk_python_files(root)]
    label = "stdlib" if roots == stdlib else "roots"
    return cls("python_code", roots, (), "", f"python_code/{label}-{_digest(roots, files)}")

  @classmethod
  def text_files(cls, patterns: Sequence[str], json_key: str) -> "LocalCorpus":
    if not patterns:
      raise DataError("data.name is 'text_files' but data.paths is empty: give comma-separated "
                      "files or globs (plain text, or .jsonl with one JSON object per line).")
    files = tuple(local_files.expand_paths(patterns))
    return cls("text_files", (), files, json_key,
               f"text_files/files-{_digest(files, files, [json_key])}")

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


def _digest(names: Sequence[str], files: Sequence[str], extra: Sequence[str] = ()) -> str:
  """A hash of `names`, every file's path, size and modification time, and `extra`."""
  stats = [f"{f}\t{s.st_size}\t{s.st_mtime_ns}" for f in files for s in [os.stat(f)]]
  return hashlib.sha256("\0".join([_FORMAT, *names, *stats, *extra]).encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class TfdsCorpus:
  """A prepared tfds dataset and the feature that holds its text."""
  builder: Any   # tfds.core.DatasetBuilder
  text_key: str
  identity: str  # name/config/version of the prepared data

  def check_split(self, split: str) -> None:
    known = self.builder.info.splits
    # Split arithmetic ("train[:90%]") is left to tfds; a mocked dataset knows no splits.
    if known and re.fullmatch(r"[\w-]+", split) and split not in known:
      raise DataError(f"Dataset '{self.identity}' has no split '{split}'; it has "
                      f"{sorted(known)}. Set data.train_split / data.eval_split.")

  def _split_info(self, split: str, field: str) -> int | None:
    info = self.builder.info.splits.get(split) if self.builder.info.splits else None
    return int(getattr(info, field)) if info is not None and getattr(info, field) else None

  def split_num_bytes(self, split: str) -> int | None:
    return self._split_info(split, "num_bytes")

  def num_documents(self, split: str) -> int | None:
    return self._split_info(split, "num_examples")

  def documents(self, split: str, start: int = 0) -> Iterator[str]:
    """The texts of `split` from document `start` on, in the prepared, deterministic order
    (invalid UTF-8 becomes U+FFFD). A plain split name skips by tfds slicing, not reading."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    skip = start
    if start and re.fullmatch(r"[\w-]+", split):
      split, skip = f"{split}[{start}:]", 0
    ds = self.builder.as_dataset(split=split, shuffle_files=False,
                                 read_config=tfds.ReadConfig(try_autocache=False))
    ds = ds.skip(skip).map(lambda example: example[self.text_key],
                           num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    for texts in tfds.as_numpy(ds.batch(_READ_BATCH)):
      yield from (text.decode("utf-8", errors="replace") for text in texts)


def _builder(name: str, data_dir: str | None):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    close = difflib.get_close_matches(name.split("/")[0],
                                      tfds.list_builders(with_community_datasets=False), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise DataError(f"data.name: unknown dataset '{name}'. Use 'python_code', 'text_files', "
                    f"'hf:<hub name | folder | files>' or a tensorflow-datasets name (see tfds.list_builders()).{hint}") from None
  try:
    with _prepare_lock(os.fspath(builder.data_dir)):
      info_file = os.path.join(builder.data_dir, "dataset_info.json")
      if not builder.info.splits and os.path.exists(info_file):
        builder.info.read_from_directory(builder.data_dir)   # another process prepared it
      builder.download_and_prepare()
  except Exception as e:  # tfds surfaces network, disk and checksum failures many ways
    raise DataError(f"data.name: the dataset '{name}' could not be prepared in "
                    f"'{builder.data_dir}' ({type(e).__name__}: {e}). Prepare it where there is "
                    "network (`tfds build NAME --data_dir=DIR`) and point data.tfds_data_dir at "
                    "that directory.") from e
  return builder


def _text_key(builder, text_key: str) -> str:
  """`text_key` when the dataset has it, else its only Text feature (logged), else an error."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  features = builder.info.features
  if text_key in features:
    return text_key
  text_features = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
  if len(text_features) != 1:
    raise DataError(f"data.text_key: dataset '{builder.name}' has no feature '{text_key}'; its "
                    f"text features are {text_features}. Set data.text_key to one of them.")
  logging.info("Dataset %s has no feature '%s'; reading its only text feature '%s'.",
               builder.name, text_key, text_features[0])
  return text_features[0]


@contextlib.contextmanager
def _prepare_lock(data_dir: str):
  """Serialises preparing one dataset across this machine's processes: the first prepares,
  the others then find it prepared. Remote storage (gs://) takes no local lock."""
  if is_remote(data_dir):
    yield
    return
  os.makedirs(os.path.dirname(data_dir.rstrip("/")), exist_ok=True)
  with open(data_dir.rstrip("/") + ".prepare.lock", "w") as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
    yield

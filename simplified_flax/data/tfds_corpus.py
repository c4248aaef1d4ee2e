"""A tensorflow-datasets corpus by name ("lm1b", "c4/en:3.0.1"): the one data module that
imports TensorFlow, and only when such a corpus is opened.

    corpus = TfdsCorpus.open("lm1b", text_key="text", data_dir=None)
    for text in corpus.documents("train", start=0): ...

The dataset must be prepared (`tfds build NAME --data_dir=DIR`); an unprepared one is prepared
here when tfds can (a download), and a failure names the command to run where there is network.
"""
import contextlib
import dataclasses
import difflib
import fcntl
import os
import re
from typing import Any, Iterator

from absl import logging

from simplified_flax.data.errors import DataError
from simplified_flax.storage import is_remote

_READ_BATCH = 256  # documents per tf.data -> numpy hop (one hop per document is slow)


@dataclasses.dataclass(frozen=True)
class TfdsCorpus:
  """A prepared tfds dataset and the feature that holds its text."""
  builder: Any   # tfds.core.DatasetBuilder
  text_key: str

  @classmethod
  def open(cls, name: str, text_key: str, data_dir: str | None) -> "TfdsCorpus":
    builder = _builder(name, data_dir)
    return cls(builder, _text_key(builder, text_key))

  @property
  def identity(self) -> str:
    """name/config/version of the prepared data."""
    return self.builder.info.full_name

  def check_split(self, split: str) -> None:
    known = self.builder.info.splits
    base = re.match(r"^[\w-]+", split)
    # Split arithmetic ("train[:90%]") is left to tfds; a mocked dataset knows no splits.
    if known and base and base.group(0) == split and split not in known:
      raise DataError(f"Dataset '{self.identity}' has no split '{split}'; it has "
                      f"{sorted(known)}. Set data.train_split / data.eval_split.")

  def split_num_bytes(self, split: str) -> int | None:
    """The recorded size of `split` on disk, or None when tfds does not know it."""
    info = self.builder.info.splits.get(split) if self.builder.info.splits else None
    return int(info.num_bytes) if info is not None and info.num_bytes else None

  def num_documents(self, split: str) -> int | None:
    info = self.builder.info.splits.get(split) if self.builder.info.splits else None
    return int(info.num_examples) if info is not None and info.num_examples else None

  def documents(self, split: str, start: int = 0) -> Iterator[str]:
    """The texts of `split` from document `start` on, in the prepared, deterministic order
    (invalid UTF-8 becomes U+FFFD). A plain split name skips by tfds slicing, not reading."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    skip = 0
    if start and re.fullmatch(r"[\w-]+", split):
      split = f"{split}[{start}:]"
    else:
      skip = start
    ds = self.builder.as_dataset(split=split, shuffle_files=False,
                                 read_config=tfds.ReadConfig(try_autocache=False))
    ds = ds.skip(skip).map(lambda example: example[self.text_key],
                           num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    for texts in tfds.as_numpy(ds.batch(_READ_BATCH)):
      for text in texts:
        yield text.decode("utf-8", errors="replace")


def _builder(name: str, data_dir: str | None):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    known = tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(name.split("/")[0], known, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise DataError(f"data.name: unknown dataset '{name}'. Use 'python_code', 'text_files' or a "
                    f"tensorflow-datasets name (see tfds.list_builders()).{hint}") from None
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
  if len(text_features) == 1:
    logging.info("Dataset %s has no feature '%s'; reading its only text feature '%s'.",
                 builder.name, text_key, text_features[0])
    return text_features[0]
  raise DataError(f"data.text_key: dataset '{builder.name}' has no feature '{text_key}'; its "
                  f"text features are {text_features}. Set data.text_key to one of them.")


@contextlib.contextmanager
def _prepare_lock(data_dir: str):
  """Serialises preparation of one dataset across this machine's processes: the first
  prepares, the others then find it prepared. Remote storage (gs://) takes no local lock."""
  if is_remote(data_dir):
    yield
    return
  parent = os.path.dirname(data_dir.rstrip("/"))
  os.makedirs(parent, exist_ok=True)
  with open(data_dir.rstrip("/") + ".prepare.lock", "w") as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock_file, fcntl.LOCK_UN)

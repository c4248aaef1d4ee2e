"""`config.data.name` -> a prepared tfds dataset whose documents are plain strings.

    corpus = open_corpus(config.data)   # prepares once (local corpora) or loads by name
    for text in corpus.documents("train"): ...

Names: "python_code" (local Python source, default the interpreter's stdlib), "text_files"
(local plain-text / JSON-lines files), or any tensorflow-datasets name with an optional config
and version ("lm1b", "c4/en:3.0.1"), whose text lives in the feature `data.text_key`.
"""
import dataclasses
import difflib
import re
from typing import Iterator, Sequence

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

from simplified_flax.data import sources
from simplified_flax.data.errors import DataError

_LOCAL_TEXT_KEY = "content"  # what both local builders call their text feature
_READ_BATCH = 256            # documents per tf.data -> numpy hop (one hop per document is slow)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A prepared tfds dataset and the feature that holds its text."""
  builder: tfds.core.DatasetBuilder
  text_key: str

  @property
  def identity(self) -> str:
    """name/config/version: names the prepared data in caches and iterator states."""
    return self.builder.info.full_name

  def split_num_bytes(self, split: str) -> int | None:
    """The recorded size of `split` on disk, or None when tfds does not know it."""
    info = self.builder.info.splits.get(split) if self.builder.info.splits else None
    return int(info.num_bytes) if info is not None and info.num_bytes else None

  def text_dataset(self, split: str, *, shuffle_files: bool = False,
                   seed: int | None = None) -> tf.data.Dataset:
    """tf.data of the split's texts (tf.string), in the prepared, deterministic order."""
    read_config = tfds.ReadConfig(shuffle_seed=seed, try_autocache=False)
    ds = self.builder.as_dataset(split=split, shuffle_files=shuffle_files,
                                 read_config=read_config)
    return ds.map(lambda example: example[self.text_key], num_parallel_calls=tf.data.AUTOTUNE,
                  deterministic=True)

  def documents(self, split: str) -> Iterator[str]:
    """The texts of `split` in a fixed order (invalid UTF-8 becomes U+FFFD)."""
    for texts in tfds.as_numpy(self.text_dataset(split).batch(_READ_BATCH)):
      for text in texts:
        yield text.decode("utf-8", errors="replace")


def parse_list(value: str | Sequence[str] | None) -> list[str]:
  """A config list: a comma-separated string or a sequence; None or '' is empty."""
  if not value:
    return []
  items = value.split(",") if isinstance(value, str) else list(value)
  return [item.strip() for item in items if item.strip()]


def open_corpus(data_config) -> Corpus:
  """The prepared dataset `data_config.name` names, with both of its splits checked."""
  name = data_config.name
  if name == "python_code":
    builder = sources.PythonCode(config=sources.python_code_config(parse_list(data_config.roots)),
                                 data_dir=data_config.tfds_data_dir)
    sources.prepare(builder)
    corpus = Corpus(builder, _LOCAL_TEXT_KEY)
  elif name == "text_files":
    paths = parse_list(data_config.paths)
    if not paths:
      raise DataError("data.name is 'text_files' but data.paths is empty: give comma-separated "
                      "files or globs (plain text, or .jsonl with one JSON object per line).")
    builder = sources.TextFiles(config=sources.text_files_config(paths, data_config.json_key),
                                data_dir=data_config.tfds_data_dir)
    sources.prepare(builder)
    corpus = Corpus(builder, _LOCAL_TEXT_KEY)
  else:
    builder = _tfds_builder(name, data_config.tfds_data_dir)
    corpus = Corpus(builder, _text_key(builder, data_config.text_key))
  for split in (data_config.train_split, data_config.eval_split):
    _check_split(corpus, split)
  return corpus


def _tfds_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    known = tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(name.split("/")[0], known, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise DataError(f"data.name: unknown dataset '{name}'. Use 'python_code', 'text_files' or a "
                    f"tensorflow-datasets name (see tfds.list_builders()).{hint}") from None
  try:
    sources.prepare(builder)
  except DataError:
    raise
  except Exception as e:  # tfds surfaces network, disk and checksum failures many ways
    raise DataError(f"data.name: the dataset '{name}' could not be prepared in "
                    f"'{builder.data_dir}' ({type(e).__name__}: {e}). Prepare it where there is "
                    "network (`tfds build NAME --data_dir=DIR`) and point data.tfds_data_dir at "
                    "that directory.") from e
  return builder


def _text_key(builder: tfds.core.DatasetBuilder, text_key: str) -> str:
  """`text_key` when the dataset has it, else its only Text feature (logged), else an error."""
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


def _check_split(corpus: Corpus, split: str) -> None:
  known = corpus.builder.info.splits
  base = re.match(r"^[\w-]+", split)
  # Split arithmetic ("train[:90%]") is left to tfds; a mocked dataset knows no splits.
  if known and base and base.group(0) == split and split not in known:
    raise DataError(f"Dataset '{corpus.identity}' has no split '{split}'; it has "
                    f"{sorted(known)}. Set data.train_split / data.eval_split.")

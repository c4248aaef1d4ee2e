"""tensorflow-datasets builders for local corpora: `python_code` and `text_files`.

Both write the usual tfds layout `<data_dir>/<name>/<config>/<version>/` with features
`{"content": Text, "path": Text}` and splits `train` / `validation` (see `local_files.py` for
the documents and the split rule). The config name carries a hash of the roots (or of the
resolved file list), so a different corpus never reuses a stale preparation, while the same
corpus is prepared once and reused by every later run:

    builder = PythonCode(config=python_code_config(["/src/a", "/src/b"]), data_dir=...)
    prepare(builder)                                  # a no-op when already prepared
    ds = builder.as_dataset(split="train", shuffle_files=False)

With no roots, `python_code` reads the running interpreter's standard library (the default
config `stdlib-py3XX-<hash>`), which makes a real code corpus available offline everywhere.
A prepared corpus is a snapshot: edit files under a root and you must delete its directory
(or bump VERSION) to see the change.
"""
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import sys
from typing import Sequence

import tensorflow_datasets as tfds

from simplified_flax.data import local_files
from simplified_flax.data.errors import DataError
from simplified_flax.data.local_files import DocRef

_VERSION = tfds.core.Version("1.0.0")
_RELEASE_NOTES = {"1.0.0": "First release: one document per file (or JSON line)."}


@dataclasses.dataclass(eq=False)
class LocalCorpusConfig(tfds.core.BuilderConfig):
  """A local corpus: `roots` (python_code) or `files` (text_files, already glob-expanded)."""
  roots: tuple[str, ...] = ()
  files: tuple[str, ...] = ()
  json_key: str = "text"


def _config_name(label: str, items: Sequence[str], *extra: str) -> str:
  digest = hashlib.sha256("\0".join([*items, *extra]).encode("utf-8")).hexdigest()
  return f"{label}-{digest[:12]}"


def _stdlib_config() -> LocalCorpusConfig:
  root = local_files.stdlib_root()
  label = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
  return LocalCorpusConfig(name=_config_name(label, [root]), roots=(root,),
                           description=f"The standard library of Python {sys.version.split()[0]}"
                           f" at {root}.")


def python_code_config(roots: Sequence[str] | None) -> LocalCorpusConfig:
  """The config for `roots` (None or empty: the interpreter's standard library)."""
  default = PythonCode.BUILDER_CONFIGS[0]
  if not roots or tuple(roots) == default.roots:
    return default  # tfds refuses a custom config that shares a predefined config's name
  roots = tuple(sorted({_absolute(r) for r in roots}))
  return LocalCorpusConfig(name=_config_name("roots", roots), roots=roots,
                           description=f"*.py files under {', '.join(roots)}.")


def text_files_config(patterns: Sequence[str], json_key: str) -> LocalCorpusConfig:
  """The config for the files named by `patterns` (globs are expanded now, so new matching
  files lead to a new preparation)."""
  files = tuple(local_files.expand_paths(patterns))
  return LocalCorpusConfig(name=_config_name("files", files, json_key), files=files,
                           json_key=json_key, description=f"{len(files)} text file(s).")


def _absolute(path: str) -> str:
  return os.path.realpath(os.path.expanduser(path))


class _LocalCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Shared generation: scan once (validating), then stream documents into tfds."""
  VERSION = _VERSION
  RELEASE_NOTES = _RELEASE_NOTES
  # Nothing is downloaded, so there is no checksum file to look up; tfds's lookup would also
  # need `importlib_resources`, which its own requirements do not pull in.
  url_infos = None

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            "content": tfds.features.Text(),
            "path": tfds.features.Text(),
        }),
        homepage="https://arxiv.org/abs/2311.01906",
    )

  def _documents(self) -> list[DocRef]:
    raise NotImplementedError

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing is downloaded
    splits = local_files.assign_splits(self._documents())
    return {name: self._generate_examples(docs) for name, docs in splits.items()}

  def _generate_examples(self, docs: Sequence[DocRef]):
    for doc, text in local_files.read_documents(docs, self.builder_config.json_key):
      yield doc.key, {"content": text, "path": doc.name}


class PythonCode(_LocalCorpusBuilder):
  """Python source files under local roots (default: the running interpreter's stdlib)."""
  BUILDER_CONFIGS = [_stdlib_config()]

  def _documents(self) -> list[DocRef]:
    return local_files.python_documents(self.builder_config.roots)


class TextFiles(_LocalCorpusBuilder):
  """Plain-text files (one document each) and JSON-lines files (one document per line)."""
  BUILDER_CONFIGS = [LocalCorpusConfig(name="unset", description="Placeholder: build with "
                                       "text_files_config(paths, json_key).")]

  def _documents(self) -> list[DocRef]:
    if not self.builder_config.files:
      raise DataError("text_files needs data.paths (comma-separated files or "
                      "globs).")
    return local_files.text_documents(self.builder_config.files, self.builder_config.json_key)


@contextlib.contextmanager
def prepare_lock(data_dir: str):
  """Serialises preparation of one dataset across processes of this machine (several hosts'
  processes, pytest workers): the first prepares, the others then find it prepared."""
  parent = os.path.dirname(data_dir.rstrip("/"))
  if "://" in data_dir:   # remote storage (gs://): no local lock to take
    yield
    return
  os.makedirs(parent, exist_ok=True)
  with open(data_dir.rstrip("/") + ".prepare.lock", "w") as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock_file, fcntl.LOCK_UN)


def prepare(builder: tfds.core.DatasetBuilder, **download_kwargs) -> None:
  """Prepares a dataset once; later calls (in any process) find it and return at once.

  Local corpora never touch the network; `download_kwargs` go to `download_and_prepare`.
  """
  if isinstance(builder, _LocalCorpusBuilder):
    download_kwargs.setdefault("download_config",
                               tfds.download.DownloadConfig(try_download_gcs=False))
  with prepare_lock(builder.data_dir):
    info_file = os.path.join(builder.data_dir, "dataset_info.json")
    if not builder.info.splits and os.path.exists(info_file):
      builder.info.read_from_directory(builder.data_dir)   # another process prepared it
    builder.download_and_prepare(**download_kwargs)

"""`data.name="hf:<source>"`: a Hugging Face `datasets` dataset as a corpus (`HfCorpus`).

    train, evals = open_hf_corpora(config.data)   # only this imports `datasets`
    train.identity                       # "hf/<source>-<hash of the selected documents>"
    for text in train.documents("train", start=0): ...

<source> is a hub name ("huggingface-course/codeparrot-ds-train": read from the cache or
downloaded; HF_DATASETS_OFFLINE=1 forbids the download), a `save_to_disk` folder, a folder of
data files, or parquet / arrow / json(l) / csv files or globs (comma-separated). The training
documents are `data.train_split` of it; the eval documents `data.eval_split` of it, or of
`data.eval_name` when that is set (a second source, same forms). A second source is a corpus
of its own (`evals`, its own identity), so the two may share a split name (two folders saved
with only a `train` split: data.eval_split=train), and their prepared shards, addressed by
identity and split, never mix; with one source `evals` is `train`. Each split is optionally
subset the way the paper's reference code does it, with datasets' own calls:
`shuffle(seed=data.shuffle_seed).select(range(data.max_train_docs))` (eval:
`max_eval_docs`); a None seed keeps the dataset's order, 0 documents means all of them.

`data.streaming=True` reads a hub name or data files as an `IterableDataset`
(`load_dataset(..., streaming=True)`), for a dataset too big to download whole: the documents
come in the dataset's order, the first N are `.take(N)` and a resumed preparation `.skip`s
the documents it has. They are the same documents as the downloaded reading's with no shuffle.
With `data.shuffle_seed` set it is refused: the reference selection is a permutation of the
whole dataset (`Dataset.shuffle`), which only the downloaded dataset has; a streamed buffer
shuffle (`IterableDataset.shuffle(buffer_size=...)`) would silently pick other documents.
A `save_to_disk` folder is read as a Dataset either way (it is local, memory-mapped Arrow), so
with only such folders the shuffle is the downloaded one and nothing is refused.
A stream has no content fingerprint, so its identity hashes what fixes its documents instead
(the builder's hash, which pins a hub dataset's revision, and its config id, which covers the
data files' paths and modification times, the split and N), not the `streaming` flag.
"""
import dataclasses
import hashlib
import os
import re
from typing import Any, Iterator

from simplified_flax.data import hf_sources
from simplified_flax.data.errors import DataError

PREFIX = "hf:"
_READ_BATCH = 256  # documents per Arrow -> Python hop


def is_hf(name) -> bool:
  return isinstance(name, str) and name.startswith(PREFIX)


def import_datasets():
  try:
    import datasets  # pylint: disable=import-outside-toplevel  (only hf: corpora need it)
  except ImportError:
    raise DataError("data.name 'hf:...' needs the `datasets` package: pip install "
                    "'simplified_flax[hf]' (or datasets and tokenizers).") from None
  return datasets


@dataclasses.dataclass(frozen=True)
class HfCorpus:
  """The selected documents of each split (one text column each), read in a fixed order."""
  splits: dict[str, Any]   # split name -> datasets.Dataset (or IterableDataset), selection applied
  text_key: str
  identity: str
  # Streamed splits: split name -> (N of .take(N), 0 for all; its field), checked at the end.
  takes: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)

  def _streamed(self, split: str) -> bool:
    return split in self.takes

  def check_split(self, split: str) -> None:
    if split not in self.splits:
      raise DataError(f"Corpus '{self.identity}' has no split '{split}'; it has "
                      f"{sorted(self.splits)}. Set data.train_split / data.eval_split.")

  def num_documents(self, split: str) -> int:
    self.check_split(split)
    if self._streamed(split):   # N, else what the dataset's card says, else unknown
      return self.takes[split][0] or _info_of(self.splits[split], split, "num_examples")
    return len(self.splits[split])

  def split_num_bytes(self, split: str) -> int | None:
    """The Arrow bytes of the text column, scaled to the selected share of its rows (a stream:
    the dataset card's bytes of the split so scaled, None when it has none)."""
    ds = self.splits[split]
    if self._streamed(split):
      total_bytes = _info_of(ds, split, "num_bytes")
      total_docs = _info_of(ds, split, "num_examples")
      n = self.takes[split][0]
      if total_bytes is None or (n and not total_docs):
        return None
      return int(total_bytes * min(n, total_docs) / total_docs) if n else total_bytes
    table_rows = max(ds.data.num_rows, 1)
    return int(ds.data.nbytes * len(ds) / table_rows)

  def documents(self, split: str, start: int = 0) -> Iterator[str]:
    """The texts of `split` from document `start` on (None becomes ""); earlier ones are
    skipped by index, not read."""
    self.check_split(split)
    ds = self.splits[split]
    if self._streamed(split):
      yield from self._stream(split, start)
      return
    if start:
      ds = ds.select(range(min(start, len(ds)), len(ds)))
    for batch in ds.iter(batch_size=_READ_BATCH):
      yield from (text or "" for text in batch[self.text_key])

  def _stream(self, split: str, start: int) -> Iterator[str]:
    n, field = self.takes[split]
    ds, count = self.splits[split], start
    if start:
      ds = ds.skip(start)
    for batch in ds.iter(batch_size=_READ_BATCH):
      if self.text_key not in batch:
        raise DataError(f"data.text_key: the split '{split}' has no column '{self.text_key}'; "
                        f"its columns are {sorted(batch)}. Set data.text_key to one of them.")
      texts = batch[self.text_key]
      count += len(texts)
      yield from (text or "" for text in texts)
    if n and count < n:
      raise DataError(f"{field} is {n:,} but the streamed split '{split}' ended after "
                      f"{count:,} documents. Set {field} to at most {count:,} (0: all).")


def open_hf_corpora(data_config) -> tuple[HfCorpus, HfCorpus]:
  """(the corpus of the training documents, that of the eval documents) of `data_config.name`
  = "hf:<source>" (module docstring): one corpus twice, or with `data.eval_name` one corpus per
  source, each with its own identity, so that the prepared shards of two sources never mix
  even when their splits have one name. Every problem is one DataError naming the source,
  split or field and what to set."""
  d = data_config
  datasets = import_datasets()
  train_source = d.name[len(PREFIX):].strip()
  eval_source = (d.get("eval_name") or "").strip()
  eval_source = eval_source[len(PREFIX):] if is_hf(eval_source) else eval_source
  if eval_source and d.train_split == d.eval_split and hf_sources.same_source(train_source, eval_source):
    raise DataError(f"data.eval_name names the source of data.name ('hf:{train_source}') and "
                    f"data.train_split == data.eval_split == '{d.train_split}': evaluation would "
                    "read the training documents. Set data.eval_name to another source or "
                    "data.eval_split to another split.")
  seed = d.get("shuffle_seed")
  streaming = bool(d.get("streaming"))
  streamed = [s for s in (train_source, eval_source) if s and not hf_sources.is_saved(s)]
  if streaming and seed is not None and streamed:   # the one refused combination (docstring)
    raise DataError(f"data.streaming=True with data.shuffle_seed={seed}: the reference selection "
                    "shuffles the whole dataset, which needs it downloaded (data.streaming=False); "
                    "unset data.shuffle_seed to stream the first documents in the dataset's order.")
  parts = [_open_part(datasets, d, train_source, d.train_split, "data.name",
                      "data.max_train_docs", seed, streaming),
           _open_part(datasets, d, eval_source or train_source, d.eval_split,
                      "data.eval_name" if eval_source else "data.name", "data.max_eval_docs",
                      seed, streaming)]
  # The train corpus's identity hashes both sources and both selections (as it always has:
  # prepared shards and iterator states of earlier runs keep their names).
  train = _corpus(train_source, eval_source, d.text_key, parts if not eval_source else parts[:1],
                  fingerprints=parts)
  if not eval_source:
    return train, train
  return train, _corpus(eval_source, "", d.text_key, parts[1:], fingerprints=parts[1:])


@dataclasses.dataclass(frozen=True)
class _Part:
  """One split of one source, selected: what an HfCorpus is made of."""
  split: str
  dataset: Any
  fingerprint: str
  take: tuple[int, str] | None   # streamed: (N of .take(N), its field)


def _open_part(datasets, d, source: str, split: str, field: str, max_field: str, seed,
               streaming: bool) -> _Part:
  max_docs = d.get(max_field.split(".")[1]) or 0
  ds, builder = hf_sources.load(datasets, source, split, field, streaming)
  if builder is None:
    ds = _subset(ds, seed, max_docs, max_field)
    fingerprint, take = getattr(ds, "_fingerprint", ""), None
  else:
    ds = _take(ds, split, max_docs, max_field)
    fingerprint = f"stream:{builder.hash}:{builder.config_id}:{max_docs}"
    take = (max_docs, max_field)
  return _Part(split, _text_column(ds, d.text_key, split), fingerprint, take)


def _corpus(source: str, second_source: str, text_key: str, parts: list[_Part], *,
            fingerprints: list[_Part]) -> HfCorpus:
  """The corpus of `parts` (splits of `source`), named "hf/<source's last name>-<hash of the
  sources, text_key and `fingerprints`' selections>"."""
  selected = sorted({(p.split, p.fingerprint) for p in fingerprints})
  digest = hashlib.sha256("\0".join(["hf-v1", source, second_source, text_key,
                                     *(f"{split}={f}" for split, f in selected)]
                                    ).encode()).hexdigest()[:12]
  slug = re.sub(r"[^\w.-]+", "_", os.path.basename(source.rstrip("/")) or "data")
  return HfCorpus({p.split: p.dataset for p in parts}, text_key, f"hf/{slug}-{digest}",
                  {p.split: p.take for p in parts if p.take is not None})


def _subset(ds, seed, max_docs: int, field: str):
  """ds.shuffle(seed=seed) unless seed is None, then its first `max_docs` (0: all)."""
  if seed is not None:
    ds = ds.shuffle(seed=int(seed))
  if max_docs:
    if max_docs > len(ds):
      raise DataError(f"{field} is {max_docs:,} but the dataset has {len(ds):,} documents. "
                      f"Set {field} to at most {len(ds):,} (0: all).")
    ds = ds.select(range(max_docs))
  return ds


def _info_of(ds, split: str, name: str) -> int | None:
  """`num_examples` / `num_bytes` of `split` from the dataset's card, None when unknown."""
  info = (getattr(ds.info, "splits", None) or {}).get(split)
  value = getattr(info, name, None) if info is not None else None
  return int(value) if value else None


def _take(ds, split: str, max_docs: int, field: str):
  """A stream's first `max_docs` documents (0: all); more than the card says is an error now,
  more than the stream has one at its end (HfCorpus.documents)."""
  if not max_docs:
    return ds
  total = _info_of(ds, split, "num_examples")
  if total is not None and max_docs > total:
    raise DataError(f"{field} is {max_docs:,} but the dataset has {total:,} documents. "
                    f"Set {field} to at most {total:,} (0: all).")
  return ds.take(max_docs)


def _text_column(ds, text_key: str, split: str):
  """`ds` with only its `text_key` column, which must hold strings (a stream whose features
  are unknown until read, e.g. json: checked as it is read)."""
  if ds.features is None:
    return ds
  if text_key not in ds.column_names:
    raise DataError(f"data.text_key: the split '{split}' has no column '{text_key}'; its "
                    f"columns are {ds.column_names}. Set data.text_key to one of them.")
  dtype = getattr(ds.features[text_key], "dtype", None)
  if dtype not in ("string", "large_string"):
    raise DataError(f"data.text_key: the column '{text_key}' of the split '{split}' holds "
                    f"{ds.features[text_key]}, not text. Set data.text_key to a text column.")
  return ds.select_columns([text_key])

"""Tokenize a config's corpus once into prepared shards, with worker processes (docs/data.md,
"Prepared shards").

    python -m simplified_flax.prepare --config=preln [--config.data.name=lm1b ...] \\
        [--workers=16] [--workdir=DIR] [--repair_shard=<shard file>]

It prepares the train split and the eval split (of `data.eval_name` when that names a second
source, which may have a split of the same name). Killed and run again, it keeps finished
shards. `--repair_shard` (the command a damaged-shard error prints) re-tokenizes only that
shard's documents, in place, and checks it against the manifest. A SentencePiece tokenizer is
trained first when needed and saved in `--workdir` (the training run's, so that both use the
same model).
"""
import os

from absl import flags

from simplified_flax import cli
from simplified_flax import retries
from simplified_flax.data import corpus
from simplified_flax.data import pipeline
from simplified_flax.data import preparation
from simplified_flax.data import tokenizers
from simplified_flax.data.errors import DataError
from simplified_flax.runs import config_checks


def prepare(config, *, workers: int, workdir: str | None,
            repair_shard: str | None = None) -> dict[str, str]:
  """Prepares the train and eval splits of `config.data` (or, with `repair_shard`, rebuilds
  only that shard file's shard of the split it belongs to); returns {part: shard directory},
  a part named by its split, the eval split of a second source (data.eval_name) as
  "eval_name:<split>"."""
  config_checks.validate_run_config(config)
  retries.configure_from(config, workdir, pipeline.shard_root(config.data))
  data = config.data
  train_source, eval_source = corpus.open_corpora(data)
  tokenizer = tokenizers.build_tokenizer(data, workdir,
                                         lambda: train_source.documents(data.train_split))
  root = pipeline.shard_root(data)
  parts = _parts(data, train_source, eval_source)
  if repair_shard is not None:
    return _repair(parts, tokenizer, root, data, repair_shard)
  directories = {}
  for part, (source, split) in parts.items():
    prepared = preparation.prepare_split(source, split, tokenizer, root,
                                         shard_docs=data.shard_docs, workers=workers)
    directories[part] = os.fspath(prepared.directory)
    print(f"{part}: {prepared.num_shards} shard(s), {prepared.num_docs:,} documents, "
          f"{int(prepared.shard_num_tokens.sum()):,} tokens in {prepared.directory}", flush=True)
  return directories


def _parts(data, train_source, eval_source) -> dict[str, tuple]:
  """{part: (corpus, split)}: the train split, then the eval split unless it is the same one
  (its own corpus when data.eval_name names a second source, so it may share the name)."""
  parts = {data.train_split: (train_source, data.train_split)}
  part = data.eval_split if eval_source is train_source else f"eval_name:{data.eval_split}"
  parts.setdefault(part, (eval_source, data.eval_split))
  return parts


def _same_folder(a: str, b: str) -> bool:
  """Whether folders `a` and `b` are one (a remote path compared as written)."""
  if "://" in a or "://" in b:
    return a.rstrip("/") == b.rstrip("/")
  return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def _repair(parts: dict[str, tuple], tokenizer, root: str, data,
            shard_file: str) -> dict[str, str]:
  """Rebuilds the shard `shard_file` names, in whichever of the config's parts holds it."""
  index = preparation.shard_index_of(shard_file)
  for part, (source, split) in parts.items():
    address = preparation.Address(source.identity, split, tokenizer.fingerprint, data.shard_docs)
    directory = address.directory(root)
    if index is not None and _same_folder(os.path.dirname(shard_file), os.fspath(directory)):
      preparation.repair_shard(source, split, tokenizer, root, shard_docs=data.shard_docs,
                               index=index)
      print(f"{part}: shard {index} rebuilt and verified in {directory}", flush=True)
      return {part: os.fspath(directory)}
  raise DataError(f"--repair_shard={shard_file} is no tokens-NNNNN.npy or docs-NNNNN.npy file "
                  "of this config's prepared splits; pass the --config flags the run used.")


def main(argv) -> None:
  f = cli.start(argv)
  prepare(f.config, workers=f.workers or os.cpu_count() or 1, workdir=f.workdir,
          repair_shard=f.repair_shard)


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag()
  flags.DEFINE_integer("workers", 0, "Tokenizing processes (0: one per CPU core).")
  flags.DEFINE_string("workdir", None, "Where a trained SentencePiece model is kept.")
  flags.DEFINE_string("repair_shard", None, "A damaged shard file to re-tokenize in place.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.prepare")

"""Tokenize a config's corpus once into prepared shards, with worker processes (README,
"Prepared shards").

    python -m simplified_flax.prepare --config=preln [--config.data.name=lm1b ...] \\
        [--workers=16] [--workdir=DIR]

Killed and run again, it keeps finished shards. A SentencePiece tokenizer is trained first
when needed and saved in `--workdir` (the training run's, so that both use the same model).
"""
import os

from absl import flags

from simplified_flax import cli
from simplified_flax.data import corpus
from simplified_flax.data import pipeline
from simplified_flax.data import preparation
from simplified_flax.data import tokenizers
from simplified_flax.runs import config_checks


def prepare(config, *, workers: int, workdir: str | None) -> dict[str, str]:
  """Prepares both splits of `config.data`; returns {split: shard directory}."""
  config_checks.validate_run_config(config)
  data = config.data
  source = corpus.open_corpus(data)
  tokenizer = tokenizers.build_tokenizer(data, workdir,
                                         lambda: source.documents(data.train_split))
  root = pipeline.shard_root(data)
  directories = {}
  for split in dict.fromkeys((data.train_split, data.eval_split)):
    prepared = preparation.prepare_split(source, split, tokenizer, root,
                                         shard_docs=data.shard_docs, workers=workers)
    directories[split] = os.fspath(prepared.directory)
    print(f"{split}: {prepared.num_shards} shard(s), {prepared.num_docs:,} documents, "
          f"{int(prepared.shard_num_tokens.sum()):,} tokens in {prepared.directory}", flush=True)
  return directories


def main(argv) -> None:
  f = cli.start(argv)
  prepare(f.config, workers=f.workers or os.cpu_count() or 1, workdir=f.workdir)


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag()
  flags.DEFINE_integer("workers", 0, "Tokenizing processes (0: one per CPU core).")
  flags.DEFINE_string("workdir", None, "Where a trained SentencePiece model is kept.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.prepare")

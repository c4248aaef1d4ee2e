"""The authors' PyTorch checkpoints in both directions (docs/evaluating.md, "Converting the
authors' checkpoints"):

    python -m simplified_flax.convert --from_authors=DIR --workdir=OUT
    python -m simplified_flax.convert --to_authors=DIR --workdir=IN [--step=S]

The first reads an authors' run (config.json + model.safetensors, or pytorch_model.bin where
torch is installed) and writes a new workdir that evaluate, sample and train read (one
checkpoint, step 0, with a fresh optimiser state); the second writes the latest good
checkpoint of IN (or step S) as config.json + model.safetensors in their names and layout.
A model the other side cannot express, or an output folder that is not empty, fails in one
line; nothing is written then.
"""
from absl import app
from absl import flags

from simplified_flax import cli
from simplified_flax.authors import dirs


def main(argv) -> None:
  f = cli.start(argv)
  if (f.from_authors is None) == (f.to_authors is None):
    raise app.UsageError("Give exactly one of --from_authors=DIR (their run -> a new --workdir) "
                         "and --to_authors=DIR (--workdir -> their format).",
                         exitcode=cli.USAGE_ERROR)
  if f.from_authors is not None:
    done = dirs.workdir_from_authors(f.from_authors, f.workdir, seed=f.seed)
    overrides = "".join(f" --config.model.{k}={v}" for k, v in sorted(done.overrides.items()))
    print(f"Wrote {done.out}: step 0 of the authors' weights, a fresh optimiser state; its "
          f"config is configs/{done.variant}.py with model fields of theirs. Continue training "
          f"with: python -m simplified_flax.train --config={done.variant}{overrides} "
          f"--workdir={done.out}", flush=True)
    for note in done.notes:
      print(f"Note: {note}", flush=True)
  else:
    done = dirs.authors_from_workdir(f.workdir, f.to_authors, step=f.step)
    print(f"Wrote {done.out} ({dirs.SAFETENSORS_FILE} + config.json) from "
          f"{'; '.join(done.notes)}.", flush=True)


if __name__ == "__main__":
  flags.DEFINE_string("from_authors", None, "An authors' run folder to convert into --workdir.")
  flags.DEFINE_string("to_authors", None, "A new folder to write --workdir's checkpoint to, in "
                      "the authors' format.")
  flags.DEFINE_string("workdir", None, "This code's workdir: written by --from_authors (must be "
                      "new or empty), read by --to_authors.", required=True)
  flags.DEFINE_integer("step", None, "--to_authors: this checkpoint step (default: the latest).")
  flags.DEFINE_integer("seed", 0, "--from_authors: the workdir's config.seed (the data order "
                       "and dropout of continued training).")
  cli.run(main, "simplified_flax.convert")

"""Evaluation of a training run's checkpoint from the command line (docs/evaluating.md,
"Evaluating").

    python -m simplified_flax.evaluate --workdir=DIR [--eval_steps=N] [--step=S] [--quantize=w8a8]

prints one JSON line {"step", "eval_loss", "eval_perplexity", "eval_tokens"} for the latest
good checkpoint (or step S) on N validation batches (`--quantize`: also with int8 layers).
"""
import json

from absl import flags
import jax

from simplified_flax import cli
from simplified_flax.model import quantize
from simplified_flax.runs import compilation_cache
from simplified_flax.runs import distributed
from simplified_flax.training.evaluation import evaluate   # the library call behind the CLI


def main(argv) -> None:
  f = cli.start(argv)
  compilation_cache.enable(*compilation_cache.choose(f.compilation_cache_dir))   # not the run's
  distributed.initialize_distributed(f.coordinator_address, f.num_processes, f.process_id,
                                     auto=f.distributed)
  result = evaluate(f.workdir, f.eval_steps, step=f.step, quantize_scheme=f.quantize)
  if jax.process_index() == 0:
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The --workdir of a training run.", required=True)
  flags.DEFINE_integer("eval_steps", None, "Eval batches (default: the saved config's).")
  flags.DEFINE_integer("step", None, "Evaluate this checkpoint step (default: the latest).")
  flags.DEFINE_enum("quantize", "none", list(quantize.SCHEMES),
                    "Also evaluate with int8 fake-quantised linear layers: weights per output "
                    "channel (w8), inputs per tensor (a8), or both (w8a8).")
  compilation_cache.define_flag()
  distributed.define_distributed_flags()
  cli.run(main, "simplified_flax.evaluate")

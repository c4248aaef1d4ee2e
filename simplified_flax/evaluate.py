"""Evaluation: the CLI that evaluates a workdir's latest checkpoint, and the library calls.

    python -m simplified_flax.evaluate --workdir=DIR [--eval_steps=N] [--step=S] [--quantize=w8a8]

restores the latest good checkpoint of DIR (or the kept step S) with its saved `config.json`
and prints one JSON line {"step", "eval_loss", "eval_perplexity", "eval_tokens"} for the first
N (default: the config's `eval_steps`) validation batches. `--quantize=w8|a8|w8a8` scores the
same batches again with every linear layer's weights (per output channel) and/or inputs (per
tensor) fake-quantised to int8 (model/quantize.py), adding "quantized_eval_loss" and
"quantized_loss_increase".
"""
import json

from absl import flags
import jax

from simplified_flax import cli
from simplified_flax.model import quantize
from simplified_flax.runs import distributed
from simplified_flax.training.evaluation import evaluate, load_config, restore_read_only, run_eval

__all__ = ["evaluate", "load_config", "restore_read_only", "run_eval"]


def main(argv) -> None:
  f = cli.start(argv)
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
  distributed.define_distributed_flags()
  cli.run(main, "simplified_flax.evaluate")

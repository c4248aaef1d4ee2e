"""Training: the library API and the command line behind it (docs/training.md).

    python -m simplified_flax.train --config=sas_p:cpu --workdir=DIR [--config.key=value ...] \\
        [--coordinator_address=host:port --num_processes=N --process_id=i]

A workdir with checkpoints resumes from the latest good one; SIGTERM saves and exits 0.
Library use: `train_and_evaluate(config, workdir)`, or the pure steps of training/step.py.
"""
from simplified_flax import cli

if __name__ == "__main__":
  from simplified_flax.runs import distributed  # pylint: disable=g-import-not-at-top
  distributed.supervise_if_multihost("simplified_flax.train")   # multi-host: a watched child
  cli.exit_on_sigterm()   # before the slow imports below: SIGTERM in start-up exits 0

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags

from simplified_flax.runs import compilation_cache
from simplified_flax.runs import distributed
from simplified_flax.training.loop import NonFiniteLossError, train_and_evaluate
from simplified_flax.training.step import (StepSpec, TrainState, create_train_state,
                                           diagnostics_step, eval_step, train_step)

__all__ = ["create_train_state", "train_step", "eval_step", "diagnostics_step",
           "train_and_evaluate", "TrainState", "StepSpec", "NonFiniteLossError"]


def main(argv) -> None:
  f = cli.start(argv)
  compilation_cache.enable(*compilation_cache.choose(f.compilation_cache_dir, f.config))
  distributed.initialize_distributed(f.coordinator_address, f.num_processes, f.process_id,
                                     auto=f.distributed)
  train_and_evaluate(f.config, f.workdir, tensorboard=f.tensorboard)   # checks the config first


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag()
  flags.DEFINE_string("workdir", None, "Checkpoints, metrics and config go here.",
                      required=True)
  flags.DEFINE_bool("tensorboard", True, "Also write TensorBoard event files.")
  flags.mark_flags_as_required(["config"])
  compilation_cache.define_flag()
  distributed.define_distributed_flags()
  cli.run(main, "simplified_flax.train")

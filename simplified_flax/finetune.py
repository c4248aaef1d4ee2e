"""GLUE fine-tuning of a pretrained encoder: the paper's recipe, one task per run.

    python -m simplified_flax.finetune --config=bert_sas_p \\
        --pretrained_workdir=DIR --task=sst2 [--workdir=OUT] [--finetune.epochs=5 ...]

`--config` is the pretraining config (default: `DIR/config.json`); it must give the
checkpoint's parameter shapes. The recipe (`finetune_defaults`, each field a flag
`--finetune.<field>`): 5 epochs, batch 32, AdamW at peak lr 1.5e-4 with 10% linear warm-up then
linear decay, dropout 0.1 in the encoder and the head; betas, eps and clipping stay the
pretraining ones. Each validation split is scored with the task's metrics after every epoch.

Writes to OUT (default `DIR/glue/<task>`) `metrics.jsonl` (loss rows every `log_every_steps`,
a row per epoch with `<split>/<metric>` and `score`) and `result.json` (the last epoch's
metrics and score, the number that enters the GLUE average). A NaN or infinite loss stops the
run with NonFiniteLossError.
"""
import json

from absl import flags

from simplified_flax import cli
from simplified_flax.glue import tasks
from simplified_flax.glue.finetune import finetune, finetune_defaults

__all__ = ["finetune", "finetune_defaults"]


def main(argv) -> None:
  f = cli.start(argv)
  result = finetune(f.pretrained_workdir, f.task, f.workdir, config=f.config, ft=f.finetune,
                    tensorboard=f.tensorboard)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag("config", "The pretraining config (bert_sas_p, a bert_* name "
                                  "or a file path; default: <pretrained_workdir>/config.json).")
  config_flags.DEFINE_config_dict("finetune", finetune_defaults(), "The fine-tuning recipe.")
  flags.DEFINE_string("pretrained_workdir", None, "The --workdir of an MLM pretraining run.",
                      required=True)
  flags.DEFINE_string("task", None, f"A GLUE task: {', '.join(sorted(tasks.TASKS))}.",
                      required=True)
  flags.DEFINE_string("workdir", None, "Output folder (default <pretrained_workdir>/glue/TASK).")
  flags.DEFINE_bool("tensorboard", False, "Also write TensorBoard event files.")
  cli.run(main, "simplified_flax.finetune")

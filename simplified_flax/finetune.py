"""GLUE fine-tuning of a pretrained encoder (docs/encoders.md, "Fine-tuning on a GLUE task").

    python -m simplified_flax.finetune --config=bert_sas_p \\
        --pretrained_workdir=DIR --task=sst2 [--workdir=OUT] [--finetune.epochs=5 ...]

`--config` is the pretraining config (default: `DIR/config.json`); the recipe is
`finetune_defaults`, every field a flag `--finetune.<field>`. Writes `metrics.jsonl` and
`result.json` (the score that enters the GLUE average) to OUT (default `DIR/glue/<task>`).
"""
import json

from absl import flags

from simplified_flax import cli
from simplified_flax.glue import tasks
from simplified_flax.glue.training import finetune, finetune_defaults


def main(argv) -> None:
  f = cli.start(argv)
  result = finetune(f.pretrained_workdir, f.task, f.workdir, config=f.config, ft=f.finetune,
                    tensorboard=f.tensorboard)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag("The pretraining config (bert_sas_p, a bert_* name or a "
                                  "file path; default: <pretrained_workdir>/config.json).")
  config_flags.DEFINE_config_dict("finetune", finetune_defaults(), "The fine-tuning recipe.")
  flags.DEFINE_string("pretrained_workdir", None, "The --workdir of an MLM pretraining run.",
                      required=True)
  flags.DEFINE_string("task", None, f"A GLUE task: {', '.join(sorted(tasks.TASKS))}.",
                      required=True)
  flags.DEFINE_string("workdir", None, "Output folder (default <pretrained_workdir>/glue/TASK).")
  flags.DEFINE_bool("tensorboard", False, "Also write TensorBoard event files.")
  cli.run(main, "simplified_flax.finetune")

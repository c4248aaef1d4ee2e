"""The paper's Table 1 comparison: fine-tune pretrained encoders on GLUE, tabulate the scores.

    python experiments/glue_comparison.py --pretrained_root=workdirs/crammed \\
        --variants=bert_preln,bert_parallel,bert_sas,bert_sas_p,bert_value_skipinit \\
        --tfds_data_dir=/data/tensorflow_datasets [--tasks=cola,sst2,...]

expects `<pretrained_root>/<variant>` to be the --workdir of an MLM pretraining run of
`configs/<variant>.py`, and GLUE prepared in `--tfds_data_dir` (`tfds build glue/<task>` on a
host with network). Each (variant, task) runs `simplified_flax.finetune` with the paper's
recipe into `<pretrained_root>/<variant>/glue/<task>`; a finished pair (its `result.json`
exists) is not rerun. A run that diverges (NonFiniteLossError) is recorded as "NaN", as the
paper records it. Writes `<output>/glue.md` (task scores and the GLUE average, WNLI
excluded, next to the paper's averages) and `<output>/glue.json`.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from etils import epath  # pylint: disable=g-import-not-at-top
from experiments import report_lib  # pylint: disable=g-import-not-at-top
from simplified_flax.glue.tasks import get_task, glue_average  # pylint: disable=g-import-not-at-top
from simplified_flax.glue.training import (  # pylint: disable=g-import-not-at-top
    RESULT_FILE, finetune, finetune_defaults)
from simplified_flax.training.loop import NonFiniteLossError  # pylint: disable=g-import-not-at-top

PAPER_GLUE = {"bert_preln": 78.9, "bert_parallel": 78.5, "bert_sas": 78.4, "bert_sas_p": 78.3,
              "bert_value_skipinit": 78.0}
DEFAULT_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte")


def task_result(pretrained_workdir: str, task: str, ft) -> float:
  """The task score of one fine-tuning run (reused when done before), NaN if it diverged."""
  path = epath.Path(pretrained_workdir) / "glue" / task / RESULT_FILE
  if path.exists():
    return json.loads(path.read_text())["score"]
  try:
    return finetune(pretrained_workdir, task, ft=ft)["score"]
  except NonFiniteLossError as e:
    print(f"{pretrained_workdir} {task}: {e}", flush=True)
    return math.nan


def table(scores: dict[str, dict[str, float]], tasks) -> str:
  lines = ["| variant | " + " | ".join(tasks) + " | GLUE avg | paper |",
           "|---|" + "---:|" * (len(tasks) + 2)]
  for variant, by_task in scores.items():
    average = glue_average(by_task)
    cells = [f"{by_task[t]:.1f}" for t in tasks]
    paper = PAPER_GLUE.get(variant)
    lines.append(f"| {variant} | " + " | ".join(cells) +
                 f" | {average:.1f} | {paper if paper is not None else '-'} |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--pretrained_root", required=True)
  parser.add_argument("--variants", default=",".join(PAPER_GLUE))
  parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
  parser.add_argument("--tfds_data_dir", default=None)
  parser.add_argument("--output", default=None, help="default: <pretrained_root>")
  args = parser.parse_args()
  ft = finetune_defaults()
  ft.tfds_data_dir = args.tfds_data_dir
  tasks = [get_task(t).name for t in args.tasks.split(",")]
  scores = {}
  for variant in args.variants.split(","):
    workdir = os.path.join(args.pretrained_root, variant)
    scores[variant] = {t: task_result(workdir, t, ft) for t in tasks}
  output = args.output or args.pretrained_root
  epath.Path(output).mkdir(parents=True, exist_ok=True)
  report_lib.write_json(os.path.join(output, "glue.json"), scores)
  report_lib.write_text(os.path.join(output, "glue.md"), table(scores, tasks))
  print(table(scores, tasks))


if __name__ == "__main__":
  main()

"""Crammed-BERT MLM pretraining of Pre-LN, SAS and SAS-P encoders: loss curves and a report.

    python experiments/mlm_pretraining.py --scale=cpu          # ~25 min on 2 busy CPU cores
    python experiments/mlm_pretraining.py --scale=paper        # the configs as they are (GPU/TPU)

Each variant is a `python -m simplified_flax.train` command run by the sweep package
(`simplified_flax.sweeps.execute.run_all`; `--jobs=N` runs N at a time; logs in
`<workdir_root>/logs/<variant>.log`) on the config's corpus (default: the embedded Python
source corpus, byte tokenizer) in `<workdir_root>/<variant>`; a rerun skips finished runs and
resumes interrupted ones from their checkpoints, a failed run is listed in the report with
its error line (exit status 1), and SIGTERM stops the runs with their checkpoints (exit status
0: rerun the same command to resume). Then the initial model (the run's seed) and the final
one (restored from the workdir's last checkpoint) are scored on the validation batches the
loop's evals use (MLM loss and accuracy over the masked tokens), and `<output>/` gets
`report.md`, `mlm_loss.png` (train and eval MLM loss vs step) and `results.json`.

Scales: `paper` runs the config files unchanged (16 layers, D=768, batch 128, 40K steps).
`cpu` starts from the files' `:cpu` switch and shrinks further (SCALES below) so that three
runs fit in ~30 minutes on a shared 2-core machine; it shows the loss falling and the
variants' relative behaviour early in training, not the paper's numbers.
"""
import os
import sys

# Run as a script from anywhere: the repository root holds `configs` and `simplified_flax`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from experiments import report_lib  # pylint: disable=g-import-not-at-top
from simplified_flax import train  # pylint: disable=g-import-not-at-top
from simplified_flax.training import evaluation  # pylint: disable=g-import-not-at-top
from simplified_flax.training import losses  # pylint: disable=g-import-not-at-top
from simplified_flax.data import build_pipeline  # pylint: disable=g-import-not-at-top
from simplified_flax.model.transformer import build_model  # pylint: disable=g-import-not-at-top

VARIANTS = ("bert_preln", "bert_sas", "bert_sas_p")
SCALES = {
    "paper": {"arg": "", "overrides": {}},
    "cpu": {"arg": "cpu", "overrides": {
        "model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.context_length": 128,
        "batch_size": 16, "num_train_steps": 600, "log_every_steps": 10,
        "eval_every_steps": 100, "eval_steps": 8, "checkpoint_every_steps": 300,
    }},
}
PAPER_GLUE = {"bert_preln": 78.9, "bert_parallel": 78.5, "bert_sas": 78.4, "bert_sas_p": 78.3,
              "bert_value_skipinit": 78.0}


def run_overrides(scale: str, num_train_steps: int | None = None,
                  extra: dict | None = None) -> dict:
  """The run's `--config.FIELD=VALUE` overrides, as Python values."""
  overrides = dict(SCALES[scale]["overrides"], **(extra or {}))
  if num_train_steps:
    overrides["num_train_steps"] = num_train_steps
  return overrides


def make_config(variant: str, scale: str, num_train_steps: int | None = None,
                extra: dict | None = None):
  """The config the run trains (what its train command parses)."""
  return report_lib.make_config(variant, SCALES[scale]["arg"],
                                run_overrides(scale, num_train_steps, extra))


def mlm_scores(config, params, constants, batches) -> dict[str, float]:
  """MLM loss (mean over masked tokens) and accuracy of a model on fixed eval batches."""
  model = build_model(config.model, dtype=config.dtype)

  @jax.jit
  def sums_fn(batch):
    logits_BTV = model.apply({"params": params, **constants}, batch["inputs"],
                             key_mask=batch.get("key_mask"), segment_ids=batch.get("segment_ids"))
    return losses.loss_sums(logits_BTV, batch, "encoder", with_correct=True)

  total = None
  for batch in batches:
    sums = sums_fn(batch)
    total = sums if total is None else jax.tree.map(np.add, total, sums)
  total = jax.device_get(total)
  return {"mlm_loss": float(total["loss_sum"] / total["weight_sum"]),
          "mlm_accuracy": losses.mlm_accuracy(total),
          "masked_tokens": float(total["weight_sum"])}


def score_run(summary: dict, final_eval_batches: int | None) -> dict:
  """MLM scores at init and at the end of a finished run: the run's config (its workdir's
  config.json), the initial state from its seed, the final state restored from its last
  checkpoint, both on the same validation batches."""
  workdir = summary["workdir"]
  config = evaluation.load_config(workdir)
  final = evaluation.restore_read_only(workdir, config).state
  pipeline = build_pipeline(config, workdir=workdir)
  initial = train.create_train_state(config, jax.random.PRNGKey(config.seed))
  batches = list(pipeline.eval_batches(final_eval_batches or config.eval_steps))
  return {
      "variant": summary["variant"], "workdir": workdir, "steps": summary["steps"],
      "params": summary["params"],
      "initial": mlm_scores(config, initial.params, initial.constants, batches),
      "final": mlm_scores(config, final.params, final.constants, batches),
      "tokens_per_s": summary["tokens_per_s"], "train_s": summary["train_s"],
      "history": summary["history"],
      "model": {k: config.model[k] for k in ("n_layer", "n_embd", "n_head", "context_length")},
      "mlp_block_resid_gain": config.model.mlp_block_resid_gain,
      "learning_rate": config.optimizer.learning_rate, "batch_size": config.batch_size,
  }


def plot(results: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
  for r in results:
    rows = [row for row in r["history"] if "loss" in row]
    steps, loss = np.array([row["step"] for row in rows]), np.array([row["loss"] for row in rows])
    ax_train.plot(steps, loss, label=r["variant"], alpha=0.85)
    evals = [(0, r["initial"]["mlm_loss"])] + [(row["step"], row["eval_loss"])
                                              for row in r["history"] if "eval_loss" in row]
    ax_eval.plot(*zip(*evals), marker="o", label=r["variant"])
  for ax, title in ((ax_train, "train MLM loss (per logged step)"),
                    (ax_eval, "eval MLM loss (validation split)")):
    ax.set_xlabel("step")
    ax.set_ylabel("MLM cross-entropy (nats / masked token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  report_lib.save_figure(fig, path, dpi=120)


def report(results: list[dict], scale: str, command: str,
           failed: dict[str, str] | None = None) -> str:
  r0 = results[0]
  lines = [
      f"# MLM pretraining of crammed-BERT encoders (`--scale={scale}`)", "",
      f"Command: `{command}`", "",
      f"Model: {r0['model']}; batch {r0['batch_size']} sequences; {r0['steps']} steps; "
      f"masking rate 0.25; corpus and tokenizer from the config (embedded Python source, "
      f"bytes). Initial and final scores are on the same {int(r0['final']['masked_tokens'])} "
      f"masked validation tokens.", "",
      "| variant | params | lr | MLP gain | MLM loss at init | final MLM loss | "
      "final MLM accuracy | tokens/s | train time | loss reduced |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
  ]
  for r in results:
    i, f = r["initial"], r["final"]
    speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
    train_time = f"{r['train_s'] / 60:.1f} min" if r["train_s"] else "-"
    lines.append(f"| {r['variant']} | {r['params']:,} | {r['learning_rate']:g} | "
                 f"{r['mlp_block_resid_gain']:g} | {i['mlm_loss']:.3f} | {f['mlm_loss']:.3f} | "
                 f"{100 * f['mlm_accuracy']:.1f}% | {speed} | {train_time} | "
                 f"{'yes' if f['mlm_loss'] < i['mlm_loss'] else 'NO'} |")
  lines += [
      "", "![MLM loss vs step](mlm_loss.png)", "",
      "Tokens/s is the median logged training throughput on this machine (shared with other "
      "jobs, so only a rough guide; the paper's speed ratios need `experiments/` benchmarks on "
      "an accelerator). At init SAS and SAS-P compute nearly the same function (identity "
      "attention, MLP branch scaled by 0.05), so their curves start together. For reference, the paper's GLUE averages after 24 h of crammed-BERT "
      "pretraining: " + ", ".join(f"{k} {v}" for k, v in PAPER_GLUE.items()) + ".", "",
  ]
  lines += report_lib.failed_lines(failed or {})
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = report_lib.experiment_parser("mlm_pretraining", __doc__, SCALES, VARIANTS,
                                        report_only=False)
  parser.add_argument("--final_eval_batches", type=int, default=None,
                      help="validation batches scored at init and end (default: eval_steps, "
                      "the same batches the training loop's evals use)")
  parser.add_argument("--num_train_steps", type=int, default=None,
                      help="override the scale's step count (quick checks)")
  args = parser.parse_args()
  output, workdir_root = report_lib.output_folders(args, "mlm_pretraining")
  extra = report_lib.parse_overrides(args.set)
  arg = SCALES[args.scale]["arg"]
  trained = report_lib.train_planned(
      [(variant, report_lib.config_spec(variant, arg),
        run_overrides(args.scale, args.num_train_steps, extra), {"variant": variant})
       for variant in args.variants.split(",")], workdir_root, report_only=False, jobs=args.jobs)
  report_lib.require_results(trained)
  results = []
  for summary in trained.results:
    results.append(score_run(summary, args.final_eval_batches))
    r = results[-1]
    print(f"{r['variant']}: MLM loss {r['initial']['mlm_loss']:.3f} -> "
          f"{r['final']['mlm_loss']:.3f}, accuracy {100 * r['final']['mlm_accuracy']:.1f}%",
          flush=True)
  plot(results, os.path.join(output, "mlm_loss.png"))
  command = report_lib.command_line("mlm_pretraining", args, parser,
                                    ("variants", "final_eval_batches", "num_train_steps"))
  report_lib.write_report(output, report(results, args.scale, command, trained.failed),
                          [{k: v for k, v in r.items() if k not in ("history", "workdir")}
                           for r in results])
  print(f"Wrote {output}/report.md, mlm_loss.png, results.json")
  report_lib.exit_if_failed(trained.failed)


if __name__ == "__main__":
  main()

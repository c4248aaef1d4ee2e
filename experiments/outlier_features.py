"""Outlier features over training (He et al. 2024, "Understanding and Minimising Outlier
Features"): Pre-LN, OP and SAS-P, each with AdamW and with Muon, and what int8 costs them.

    python experiments/outlier_features.py --scale=cpu     # 12 runs, L=4, D=128: ~40 min, 2 cores
    python experiments/outlier_features.py --scale=paper   # the configs' shape (L=18, D=768): GPU

1. A learning-rate sweep of Pre-LN and OP with AdamW (`--sweep_lrs`) picks the rate: the one
   where Pre-LN + AdamW's peak kurtosis is largest among the rates at which it trains (final
   eval loss within `--trains_within` nats of its best); `--lr` fixes it instead.
2. At that rate every variant trains with each optimiser (`--optimizers`), the same data, order,
   seed and steps; the signal-propagation diagnostics (training/diagnostics.py) log each
   layer's kurtosis and max/median ratio every `diagnostics_every` steps.
3. Each final checkpoint is evaluated in full precision and W8A8 (model/quantize.py: int8,
   weights per output channel, activations per tensor) on the same validation batches.
`<output>/` gets report.md, kurtosis_<variant>_<optimizer>.png (one line per layer),
kurtosis_all.png, lr_sweep.png and results.json. Each run is a `python -m simplified_flax.train`
command run by the sweep package (`simplified_flax.sweeps.execute.run_all`: the sweep's runs,
then the comparison's; `--jobs=N` runs N at a time; logs in `<workdir_root>/logs/<name>.log`)
in `<workdir_root>/<name>`; step 3 restores each final checkpoint from its workdir. A rerun
skips finished runs and resumes interrupted ones; a run whose loss turns non-finite is kept as
diverged (not retried), another failure is listed in the report with its error line (exit
status 1); SIGTERM stops the runs with their checkpoints (exit status 0: rerun the same
command to resume).

Expected at `--scale=paper` (the paper's result): Pre-LN + AdamW grows outlier features (peak
kurtosis far above OP's), OP keeps kurtosis low, the non-diagonal optimiser lowers it further,
and W8A8 costs Pre-LN + AdamW several times more eval loss than OP. Expected at `--scale=cpu`
(experiments/results/cpu/outlier_features): the sweep picks 3e-3; Pre-LN's kurtosis rises over
training while OP's falls (about 8x apart at the end, about 2x at the peak), Muon lowers it in
every block, and int8 costs every run under 0.001 nats, so the paper's quantisation gap does
not show at this size. "Kurtosis" is the project's metric, var over neurons of the
normalised mean square: the paper's Kurt(s) minus 1 (0 when every neuron is alike).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import outlier_report  # pylint: disable=g-import-not-at-top
from experiments import report_lib  # pylint: disable=g-import-not-at-top

VARIANTS = ("preln", "op", "sas_p")
OPTIMIZERS = ("adamw", "muon")
SWEEP_VARIANTS = ("preln", "op")
DIVERGED_FILE = "diverged.txt"
NON_FINITE = "Non-finite loss"   # the train command's error line for a diverged run
SCALES = {
    "cpu": {"arg": "cpu", "steps": 600, "sweep_lrs": "3e-2,1e-2,3e-3,1e-3",
            "diagnostics_every": 25,
            "overrides": {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4,
                          "model.context_length": 128, "batch_size": 16, "eval_steps": 8,
                          "log_every_steps": 25}},
    "paper": {"arg": "", "steps": 40_000, "sweep_lrs": "3e-4,1e-3,3e-3",
              "diagnostics_every": 500, "overrides": {"eval_steps": 20}},
}


def run_overrides(scale: str, optimizer: str, lr: float, steps: int | None = None,
                  extra: dict | None = None) -> dict:
  """The run's `--config.FIELD=VALUE` overrides, as Python values: `optimizer` at learning rate
  `lr`, diagnostics on."""
  s = SCALES[scale]
  steps = steps or s["steps"]
  overrides = dict(s["overrides"], num_train_steps=steps, eval_every_steps=steps,
                   checkpoint_every_steps=steps,
                   diagnostics_every=max(1, min(s["diagnostics_every"], steps // 4)))
  overrides.update({"optimizer.name": optimizer, "optimizer.learning_rate": lr,
                    **(extra or {})})
  return overrides


def make_config(scale: str, variant: str, optimizer: str, lr: float,
                steps: int | None = None, extra: dict | None = None):
  """The variant's config at `scale` with `optimizer` at learning rate `lr`, diagnostics on
  (what the run's train command parses)."""
  return report_lib.make_config(variant, SCALES[scale]["arg"],
                                run_overrides(scale, optimizer, lr, steps, extra))


def run_name(variant: str, optimizer: str, lr: float, steps: int) -> str:
  """The run's workdir name: every setting that differs between this script's runs."""
  return f"{variant}_{optimizer}_lr{lr:g}_s{steps}"


def kurtosis_summary(history) -> dict:
  """Peak and final max-over-layers kurtosis and max/median ratio of a run's diagnostics."""
  rows = [r for r in history if any(k.startswith("kurtosis/") for k in r)]
  if not rows:
    return {}
  worst = lambda r, name: max(v for k, v in r.items() if k.startswith(name + "/"))
  kurt = [worst(r, "kurtosis") for r in rows]
  ratio = [worst(r, "max_median_ratio") for r in rows]
  return {"peak_kurtosis": max(kurt), "final_kurtosis": kurt[-1],
          "peak_max_median": max(ratio), "final_max_median": ratio[-1],
          "kurtosis_steps": [r["step"] for r in rows], "kurtosis_max_layer": kurt}


def train_and_measure(planned, workdir_root: str, report_only: bool, jobs: int = 1):
  """Trains the (name, config spec, overrides, fields) runs of `planned` (report_lib's
  `train_planned`: the sweep package's train commands) and measures each finished one. Returns
  ({name: summary with kurtosis and W8A8 figures, or a diverged entry}, {name: error line} of
  the runs that failed otherwise). A run whose loss turns non-finite is kept as diverged
  (marked in its workdir, not retried)."""
  def diverged(name):
    _, _, overrides, fields = by_name[name]
    return {**fields, "diverged": True, "final_eval_loss": None,
            "steps": overrides["num_train_steps"]}

  by_name = {p[0]: p for p in planned}
  marker = lambda name: os.path.join(workdir_root, name, DIVERGED_FILE)
  measured = {name: diverged(name) for name in by_name if os.path.exists(marker(name))}
  trained = report_lib.train_planned([p for p in planned if p[0] not in measured],
                                     workdir_root, report_only, jobs)
  failed = {}
  for name, error in trained.failed.items():
    if NON_FINITE not in error:
      failed[name] = error
      continue
    os.makedirs(os.path.dirname(marker(name)), exist_ok=True)
    with open(marker(name), "w") as f:
      f.write(error)
    print(f"{name}: diverged ({error})", flush=True)
    measured[name] = diverged(name)
  for summary in trained.results:
    summary.update(kurtosis_summary(summary["history"]))
    summary.update(quantised_loss(summary["workdir"]))
    measured[summary["name"]] = summary
  return measured, failed


def quantised_loss(workdir: str) -> dict:
  """Full-precision and W8A8 eval loss of the final checkpoint (same batches), cached in the
  workdir so a rerun of the report evaluates nothing."""
  import json  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, "w8a8_eval.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  from simplified_flax.training import evaluation  # pylint: disable=import-outside-toplevel
  result = evaluation.evaluate(workdir, quantize_scheme="w8a8")
  out = {"fp_eval_loss": result["eval_loss"], "w8a8_eval_loss": result["quantized_eval_loss"],
         "w8a8_increase": result["quantized_loss_increase"]}
  with open(path, "w") as f:
    json.dump(out, f)
  print(f"  full precision {out['fp_eval_loss']:.4f}, W8A8 {out['w8a8_eval_loss']:.4f} "
        f"({out['w8a8_increase']:+.4f})", flush=True)
  return out


def pick_lr(sweep, trains_within: float) -> float | None:
  """The rate at which Pre-LN + AdamW's peak kurtosis is largest among those where it trains:
  a finite final eval loss within `trains_within` of its best over the sweep."""
  preln = [r for r in sweep if r["variant"] == "preln" and r.get("final_eval_loss") is not None
           and math.isfinite(r["final_eval_loss"])]
  if not preln:
    return None
  best = min(r["final_eval_loss"] for r in preln)
  trained = [r for r in preln if r["final_eval_loss"] <= best + trains_within]
  return max(trained, key=lambda r: r.get("peak_kurtosis", 0.0))["learning_rate"]


def parse_args():
  parser = report_lib.experiment_parser("outlier_features", __doc__, SCALES, VARIANTS)
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--sweep_lrs", default=None,
                      help="comma-separated learning rates of the sweep (default: the scale's)")
  parser.add_argument("--lr", type=float, default=None,
                      help="train the comparison at this rate (default: picked by the sweep)")
  parser.add_argument("--trains_within", type=float, default=0.25,
                      help="a rate 'trains' when Pre-LN's final eval loss is within this many "
                      "nats of its best over the sweep")
  parser.add_argument("--num_train_steps", type=int, default=None,
                      help="override the scale's step count (quick checks)")
  return parser.parse_args(), parser


def main() -> None:
  args, parser = parse_args()
  output, workdir_root = report_lib.output_folders(args, "outlier_features")
  extra = report_lib.parse_overrides(args.set)
  lrs = [float(x) for x in (args.sweep_lrs or SCALES[args.scale]["sweep_lrs"]).split(",")]
  variants = args.variants.split(",")
  done, failed = {}, {}

  def planned(variant, optimizer, lr):
    overrides = run_overrides(args.scale, optimizer, lr, args.num_train_steps, extra)
    name = run_name(variant, optimizer, lr, overrides["num_train_steps"])
    return (name, report_lib.config_spec(variant, SCALES[args.scale]["arg"]), overrides,
            {"variant": variant, "optimizer": optimizer, "learning_rate": lr, "name": name})

  def run(plans):
    """The summaries of `plans` (None: not finished or failed); each run trains and is
    measured once."""
    measured, failures = train_and_measure(
        [p for p in plans if p[0] not in done and p[0] not in failed], workdir_root,
        args.report_only, args.jobs)
    done.update(measured)
    failed.update(failures)
    return [(p[0], done.get(p[0])) for p in plans]

  sweep = [r for _, r in run([planned(v, "adamw", lr) for lr in lrs for v in SWEEP_VARIANTS
                              if v in variants]) if r is not None]
  lr = args.lr if args.lr is not None else pick_lr(sweep, args.trains_within)
  if lr is None:
    sys.exit("No finished Pre-LN + AdamW sweep run to pick the learning rate from: train "
             "the sweep first or give --lr." + "".join(
                 f"\n{name} failed: {error}" for name, error in failed.items()))
  compared = run([planned(v, o, lr) for o in args.optimizers.split(",") for v in variants])
  main_runs = [r for _, r in compared if r is not None]
  not_run = [name for name, r in compared if r is None and name not in failed]
  command = report_lib.command_line("outlier_features", args, parser,
                                    ("variants", "optimizers", "sweep_lrs", "lr",
                                     "num_train_steps"))
  text = outlier_report.report(main_runs, sweep, lr, args.scale, command, not_run, output,
                               args.trains_within, picked=args.lr is None)
  text += "\n".join([""] + report_lib.failed_lines(failed)) if failed else ""
  keep = ("name", "variant", "diverged", "optimizer", "learning_rate", "steps", "params",
          "final_eval_loss", "final_train_loss", "train_s", "fp_eval_loss", "w8a8_eval_loss",
          "w8a8_increase", "peak_kurtosis", "final_kurtosis", "peak_max_median",
          "final_max_median", "kurtosis_steps", "kurtosis_max_layer")
  report_lib.write_report(output, text, {
      "scale": args.scale, "command": command, "learning_rate": lr, "missing": not_run,
      "failed": failed, "sweep": [{k: r.get(k) for k in keep} for r in sweep],
      "runs": [{k: r.get(k) for k in keep} for r in main_runs]})
  print(f"Wrote {output}/report.md, its plots and results.json")
  report_lib.exit_if_failed(failed)


if __name__ == "__main__":
  main()

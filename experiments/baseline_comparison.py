"""Every decoder variant at the same budget: loss vs step and vs wall-clock, final eval loss,
parameters and throughput (the paper's Fig. 2/5 and Table 1 in one report).

    python experiments/baseline_comparison.py --scale=cpu      # ~1 h on 2 busy CPU cores
    python experiments/baseline_comparison.py --scale=paper    # L=18, D=768: a GPU/TPU host

Each run is a `python -m simplified_flax.train` command run by the sweep package
(`simplified_flax.sweeps.execute.run_all`; `--jobs=N` runs N at a time, each on its own GPUs
or TPU chips where the host has several; logs in `<workdir_root>/logs/<run>.log`) on the
embedded corpus (Python standard library source, byte tokenizer) in
`<workdir_root>/<variant>_x<budget>_s<seed>`. A rerun skips finished runs and resumes
interrupted ones from their checkpoints; a run that fails is listed in the report with its
error line (exit status 1); SIGTERM stops the runs with their checkpoints (exit status 0: rerun
the same command to resume). `--report_only` rebuilds the report from whatever runs have
finished. `<output>/` gets `report.md`, `loss_vs_step_x<b>.png`, `loss_vs_time_x<b>.png`,
`gap_to_preln.png` and `results.json`.

Budgets: every variant trains `base_steps` (budget 1x); Pre-LN and SAS-P with a second seed
for the seed-to-seed spread (mean ± sd over seeds, and SAS-P minus Pre-LN paired by seed with
its 95% t-interval: `sweeps.stats`); the cpu scale trains every variant but the naive skipless
one again 4x as long (its own schedule, not a continuation), so the report shows whether the
gap to Pre-LN narrows with training.

Scales: `paper` is the paper's shape (L=18, D=768, H=12, T=128, batch 128) at 10K and 40K
steps. `cpu` is L=4, D=128, H=4, T=128, batch 16 at 200 and 800 steps: it shows the variants
early in training on a small model, not the paper's 40K-step numbers.
"""
import os
import sys

# Run as a script from anywhere: the repository root holds `configs`, `experiments` and
# `simplified_flax`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import report_lib  # pylint: disable=g-import-not-at-top
from simplified_flax.sweeps import stats  # pylint: disable=g-import-not-at-top

VARIANTS = ("preln", "parallel", "value_skipinit", "sas", "sas_p", "sas_p_nonorm", "op",
            "naive_skipless")
CPU_SHAPE = {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4,
             "model.context_length": 128, "batch_size": 16}
SCALES = {
    "cpu": {"arg": "cpu", "overrides": CPU_SHAPE, "base_steps": 200, "budgets": (1, 4),
            "seeds": {"preln": (0, 1), "sas_p": (0, 1)},
            "long": ("preln", "sas_p", "sas", "parallel", "op", "value_skipinit",
                     "sas_p_nonorm"),
            "log_every": 10, "eval_every": 50, "eval_steps": 8},
    "paper": {"arg": "", "overrides": {}, "base_steps": 10_000, "budgets": (1, 4),
              "seeds": {"preln": (0, 1), "sas_p": (0, 1)}, "long": VARIANTS,
              "log_every": 50, "eval_every": 1_000, "eval_steps": 20},
}
# The paper's figures at 18 layers, D=768, 40K steps (CodeParrot, GPT-2 vocabulary; docs/model.md,
# "Training settings").
PAPER = {"eval_loss": {"preln": 1.155, "sas_p_nonorm": 1.245},
         "throughput": {"preln": 1.0, "parallel": 1.05, "value_skipinit": 0.95, "sas": 1.09,
                        "sas_p": 1.16, "sas_p_nonorm": 1.20}}
CPU_CAVEAT = (
    "These are short runs of a 4-layer, 128-wide model, not the paper's setting: its \"SAS "
    "matches Pre-LN\" is a claim about ~40K steps at 18 layers, and the simplified blocks' "
    "initial gains (MLP branch 0.1, identity-anchored attention) were chosen for 18 layers. "
    "Nothing was tuned for this scale: every variant runs its config file's settings with the "
    "same optimiser, batch, data and seeds. Where a simplified block trails Pre-LN here, that "
    "is the measurement at this budget; the gap table shows whether more training closes it.")
COLOURS = dict(zip(VARIANTS, ("black", "tab:orange", "tab:purple", "tab:blue", "tab:red",
                              "tab:pink", "tab:green", "tab:gray")))


# ----------------------------------------------------------------------------------- plan

def plan(scale: str, variants, budgets) -> list[tuple[str, int, int]]:
  """(variant, budget, seed) in running order: every variant at 1x first, then the extra
  seeds, then the longer budgets (so a cut run loses the least important runs)."""
  s = SCALES[scale]
  runs = [(v, 1, 0) for v in variants if 1 in budgets]
  runs += [(v, 1, seed) for v in variants for seed in s["seeds"].get(v, (0,))[1:]
           if 1 in budgets]
  runs += [(v, b, 0) for b in budgets if b != 1 for v in s["long"] if v in variants]
  return runs


def run_overrides(scale: str, budget: int, seed: int, base_steps: int,
                  extra: dict | None = None) -> dict:
  """The run's `--config.FIELD=VALUE` overrides, as Python values."""
  s = SCALES[scale]
  steps = base_steps * budget
  overrides = dict(s["overrides"], seed=seed, num_train_steps=steps,
                   log_every_steps=s["log_every"], eval_every_steps=min(s["eval_every"], steps),
                   eval_steps=s["eval_steps"], checkpoint_every_steps=max(steps // 2, 1))
  overrides.update(extra or {})
  return overrides


def make_config(scale: str, variant: str, budget: int, seed: int, base_steps: int,
                extra: dict | None = None):
  """The config the run trains (what its train command parses)."""
  return report_lib.make_config(variant, SCALES[scale]["arg"],
                                run_overrides(scale, budget, seed, base_steps, extra))


def run_name(variant: str, budget: int, seed: int) -> str:
  return f"{variant}_x{budget}_s{seed}"


# --------------------------------------------------------------------------------- report

def _by(results, budget):
  """{variant: [result of each seed]} at one budget, in VARIANTS order."""
  out = {}
  for r in results:
    if r["budget"] == budget:
      out.setdefault(r["variant"], []).append(r)
  return {v: out[v] for v in VARIANTS if v in out}


def _by_seed(results) -> dict:
  """{seed: final eval loss} of one variant's runs at one budget."""
  return {r["seed"]: r["final_eval_loss"] for r in results if r["final_eval_loss"] is not None}


def _mean(values):
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def budget_table(results, budget) -> list[str]:
  runs = _by(results, budget)
  ref = runs.get("preln")
  ref_loss = _mean([r["final_eval_loss"] for r in ref]) if ref else None
  ref_speed = _mean([r["tokens_per_s"] for r in ref]) if ref else None
  ref_params = ref[0]["params"] if ref else None
  rows = []
  for v, rs in runs.items():
    loss = _mean([r["final_eval_loss"] for r in rs])
    speed = _mean([r["tokens_per_s"] for r in rs])
    rows.append([
        f"`{v}`", f"{rs[0]['params']:,}",
        f"{rs[0]['params'] / ref_params:.3f}" if ref_params else "-",
        f"{speed:,.0f}" if speed else "-",
        f"{speed / ref_speed:.2f}" if speed and ref_speed else "-",
        f"{PAPER['throughput'][v]:.2f}" if v in PAPER["throughput"] else "-",
        f"{_mean([r['train_s'] for r in rs]) / 60:.1f} min",
        report_lib.mean_spread([r["final_eval_loss"] for r in rs]),
        f"{loss - ref_loss:+.3f}" if ref_loss is not None and v != "preln" else "-"])
  return report_lib.markdown_table(
      ["variant", "params", "params / Pre-LN", "tokens/s", "speed / Pre-LN",
       "paper speed (Table 1)", "train time", "final eval loss", "vs Pre-LN"], rows)


def _gaps(results, budgets) -> dict:
  """{variant: {budget: mean final eval loss minus Pre-LN's}}."""
  gaps = {}
  for b in budgets:
    runs = _by(results, b)
    if "preln" not in runs:
      continue
    ref = _mean([r["final_eval_loss"] for r in runs["preln"]])
    for v, rs in runs.items():
      if v != "preln":
        gaps.setdefault(v, {})[b] = _mean([r["final_eval_loss"] for r in rs]) - ref
  return gaps


def gap_table(results, budgets, output) -> list[str]:
  """Eval-loss gap to Pre-LN of every variant run at more than one budget (+ its plot)."""
  gaps = _gaps(results, budgets)
  rows = []
  for v, by_budget in gaps.items():
    if len(by_budget) < 2:
      continue
    first, last = by_budget[min(by_budget)], by_budget[max(by_budget)]
    trend = "narrows" if abs(last) < abs(first) else "widens" if abs(last) > abs(first) else "same"
    rows.append([f"`{v}`"] + [f"{by_budget[b]:+.3f}" if b in by_budget else "-"
                              for b in budgets] + [trend])
  series = {v: [{"step": b * results[0]["base_steps"], "gap": g} for b, g in sorted(by.items())]
            for v, by in gaps.items() if len(by) > 1}
  if series:
    report_lib.plot_curves(series, os.path.join(output, "gap_to_preln.png"), y="gap",
                           eval_y=None, xscale="log", xlabel="training steps (own schedule)",
                           ylabel="final eval loss minus Pre-LN's (nats / token)",
                           styles={v: {"color": COLOURS[v], "marker": "o"} for v in series},
                           title="gap to Pre-LN vs training budget")
  return report_lib.markdown_table(["variant"] + [f"gap at {b}x" for b in budgets]
                                   + ["with more training"], rows) + (
                                       ["", "![gap to Pre-LN vs budget](gap_to_preln.png)"]
                                       if series else [])


def findings(results, budgets) -> list[str]:
  """Plain sentences stating the measured figures (whatever they show)."""
  lines = []
  for b in budgets:
    runs = _by(results, b)
    if "preln" not in runs:
      continue
    ref = _mean([r["final_eval_loss"] for r in runs["preln"]])
    ranked = sorted(runs, key=lambda v: _mean([r["final_eval_loss"] for r in runs[v]]))
    steps = runs["preln"][0]["steps"]
    text = (f"- **{b}x ({steps} steps)**: lowest final eval loss first: "
            + ", ".join(f"`{v}` {_mean([r['final_eval_loss'] for r in runs[v]]):.3f}"
                        for v in ranked) + ".")
    for v in ("sas", "sas_p"):
      if v in runs:
        gap = _mean([r["final_eval_loss"] for r in runs[v]]) - ref
        verdict = "trails" if gap > 0 else "beats"
        paired = stats.paired_interval(_by_seed(runs["preln"]), _by_seed(runs[v]))
        size = (f" (paired over {paired.n} seeds: 95% interval [{paired.low:+.3f}, "
                f"{paired.high:+.3f}], {paired.verdict()})" if paired and paired.low is not None
                else "")
        text += f" `{v}` {verdict} Pre-LN by {abs(gap):.3f} nats{size}."
    lines.append(text)
  gaps = _gaps(results, budgets)
  for v in ("sas", "sas_p"):
    by = gaps.get(v, {})
    if len(by) > 1:
      lo, hi = min(by), max(by)
      trend = "narrows" if abs(by[hi]) < abs(by[lo]) else "widens"
      lines.append(f"- `{v}`'s gap to Pre-LN {trend} with training: {by[lo]:+.3f} at {lo}x, "
                   f"{by[hi]:+.3f} at {hi}x.")
  return lines


def plots(results, budgets, output) -> list[str]:
  """Writes the PNGs; returns their markdown image lines."""
  lines = []
  for b in budgets:
    runs = _by(results, b)
    if not runs:
      continue
    series, styles = {}, {}
    for v, rs in runs.items():
      for r in rs:
        name = v if r["seed"] == 0 else f"{v} (seed {r['seed']})"
        series[name] = r["history"]
        styles[name] = {"color": COLOURS[v], "linestyle": "-" if r["seed"] == 0 else "--"}
    steps = rs[0]["steps"]
    for x, xlabel, name in (("step", "step", "step"), ("elapsed_s", "wall-clock seconds",
                                                        "time")):
      path = f"loss_vs_{name}_x{b}.png"
      report_lib.plot_curves(series, os.path.join(output, path), x=x, xlabel=xlabel,
                             styles=styles, title=f"train loss (lines) and eval loss (dots), "
                             f"{steps} steps ({b}x budget)")
      lines += [f"![loss vs {name}, {b}x]({path})", ""]
  return lines


def report(results, scale, budgets, command, missing, output, failed=None) -> str:
  r0 = results[0]
  model = {k: r0["model"][k] for k in ("n_layer", "n_embd", "n_head", "context_length")}
  lines = [
      f"# Baseline comparison of the decoder variants (`--scale={scale}`)", "",
      f"Command: `{command}`", "",
      f"Model {model}, batch {r0['batch_size']} sequences, AdamW lr "
      f"{r0['learning_rate']:g} with 5% warm-up and linear decay, on the embedded corpus "
      f"(Python standard library source, byte tokenizer). Final eval loss: the loop's last "
      f"evaluation, {r0['eval_steps']} validation batches, the same batches for every run. "
      f"Seed-to-seed spread: mean ± sample standard deviation over seeds; a paired interval "
      f"is the 95% t-interval of the per-seed differences (same seed: same data order and "
      f"initialisation). Tokens/s is "
      f"the median logged training throughput on this machine, which was shared with other "
      f"jobs: a rough guide only (`experiments/throughput.py` measures speed properly).", ""]
  for b in budgets:
    if _by(results, b):
      lines += [f"## Budget {b}x: {b * r0['base_steps']} steps", ""]
      lines += budget_table(results, b) + [""]
  if len(budgets) > 1:
    lines += ["## Does the gap to Pre-LN narrow with training?", "",
              "Final eval loss minus Pre-LN's (mean over seeds), at each budget:", ""]
    lines += gap_table(results, budgets, output) + [""]
  lines += ["## What the figures say", ""] + findings(results, budgets) + [""]
  if scale == "cpu":
    lines += [CPU_CAVEAT, ""]
  lines += ["## Curves", ""] + plots(results, budgets, output)
  lines += [
      "## Paper reference", "",
      "At 18 layers, D=768, 40K steps on CodeParrot the paper reports Pre-LN eval loss ~1.155 "
      "and SAS-P without norm ~1.245, with SAS matching Pre-LN per step, and throughput "
      "relative to Pre-LN of " + ", ".join(f"{k} {v:.2f}" for k, v in
                                            PAPER["throughput"].items()) + " (paper Table 1).", ""]
  if missing:
    lines += ["## Not run", "", "These planned runs had not finished when the report was "
              "written: " + ", ".join(f"`{m}`" for m in missing) + ".", ""]
  lines += report_lib.failed_lines(failed or {})
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main

def main() -> None:
  parser = report_lib.experiment_parser("baseline_comparison", __doc__, SCALES, VARIANTS)
  parser.add_argument("--budgets", default=None, help="comma-separated multiples of the base "
                      "steps (default: the scale's, 1,4)")
  parser.add_argument("--base_steps", type=int, default=None,
                      help="override the scale's 1x step count (quick checks)")
  args = parser.parse_args()
  s = SCALES[args.scale]
  output, workdir_root = report_lib.output_folders(args, "baseline_comparison")
  budgets = tuple(int(b) for b in args.budgets.split(",")) if args.budgets else s["budgets"]
  base_steps = args.base_steps or s["base_steps"]
  extra = report_lib.parse_overrides(args.set)

  def runs():
    for variant, budget, seed in plan(args.scale, args.variants.split(","), budgets):
      overrides = run_overrides(args.scale, budget, seed, base_steps, extra)
      learning_rate = report_lib.make_config(variant, s["arg"],
                                             overrides).optimizer.learning_rate
      yield (run_name(variant, budget, seed), report_lib.config_spec(variant, s["arg"]),
             overrides, {"variant": variant, "budget": budget, "seed": seed,
                         "base_steps": base_steps, "learning_rate": learning_rate})

  trained = report_lib.train_planned(runs(), workdir_root, args.report_only, args.jobs)
  report_lib.require_results(trained)
  command = report_lib.command_line("baseline_comparison", args, parser,
                                    ("variants", "budgets", "base_steps"))
  report_lib.write_runs_report(
      output, report(trained.results, args.scale, budgets, command, trained.missing, output,
                     trained.failed),
      scale=args.scale, command=command, trained=trained,
      keep=("variant", "budget", "seed", "steps", "params", "final_eval_loss",
            "final_train_loss", "tokens_per_s", "train_s"))
  report_lib.exit_if_failed(trained.failed)


if __name__ == "__main__":
  main()

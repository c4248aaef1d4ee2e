"""The variants at two depths (the paper's 18 vs 72 layers): does each still train when deep?

    python experiments/depth_scaling.py --scale=cpu       # L=2 vs L=8, 1000 steps; ~35 min, 2 cores
    python experiments/depth_scaling.py --scale=paper     # L=18 vs L=72, 40K steps: GPU/TPU

Each (variant, depth) is a `python -m simplified_flax.train` command run by the sweep package
(`simplified_flax.sweeps.execute.run_all`; `--jobs=N` runs N at a time; logs in
`<workdir_root>/logs/<run>.log`) in `<workdir_root>/<variant>_L<depth>`. A rerun skips finished
runs and resumes interrupted ones; a failed run is listed in the report with its error line
(exit status 1); SIGTERM stops the runs with their checkpoints (exit status 0: rerun the same
command to resume). `--report_only` reports whatever has finished. `<output>/` gets
`report.md`, `loss_vs_step_L<depth>.png` and `results.json`.

The MLP branch gain of the shaped-attention variants (SAS, SAS-P, ...) follows the paper's
O(1/sqrt(L)) rule anchored at its value at 18 layers: gain(L) = gain(18) * sqrt(18 / L)
(`--no_scale_mlp_gain` keeps the config's value at every depth). Every other setting is the
config's, the same at both depths.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import report_lib  # pylint: disable=g-import-not-at-top

VARIANTS = ("preln", "sas", "sas_p", "op")
REFERENCE_DEPTH = 18   # the depth the configs' gains were set for
SCALES = {
    "cpu": {"arg": "cpu", "depths": (2, 8), "steps": 1000, "log_every": 20, "eval_every": 100,
            "eval_steps": 8, "overrides": {"model.n_embd": 128, "model.n_head": 4,
                                           "model.context_length": 128, "batch_size": 16}},
    "paper": {"arg": "", "depths": (18, 72), "steps": 40_000, "log_every": 50,
              "eval_every": 1_000, "eval_steps": 20, "overrides": {}},
}


def run_overrides(scale: str, variant: str, depth: int, scale_mlp_gain: bool = True,
                  steps: int | None = None, extra: dict | None = None) -> dict:
  """The run's `--config.FIELD=VALUE` overrides, as Python values: the scale's, then `extra`,
  then (shaped attention, `scale_mlp_gain`) the config's MLP branch gain rescaled to `depth`."""
  s = SCALES[scale]
  steps = steps or s["steps"]
  overrides = dict(s["overrides"], num_train_steps=steps, log_every_steps=s["log_every"],
                   eval_every_steps=min(s["eval_every"], steps), eval_steps=s["eval_steps"],
                   checkpoint_every_steps=max(steps // 2, 1))
  overrides.update({"model.n_layer": depth, **(extra or {})})
  config = report_lib.make_config(variant, s["arg"], overrides)
  if scale_mlp_gain and config.model.centre_attn:
    overrides["model.mlp_block_resid_gain"] = (config.model.mlp_block_resid_gain
                                               * math.sqrt(REFERENCE_DEPTH / depth))
  return overrides


def make_config(scale: str, variant: str, depth: int, scale_mlp_gain: bool = True,
                steps: int | None = None, extra: dict | None = None):
  """The config the run trains (what its train command parses)."""
  return report_lib.make_config(variant, SCALES[scale]["arg"], run_overrides(
      scale, variant, depth, scale_mlp_gain, steps, extra))


def findings(loss, depths) -> list[str]:
  """One bullet per variant: its gap to Pre-LN at each depth and whether depth narrows it,
  and what going deeper did to its own loss; stated as measured."""
  shallow, deep = depths[0], depths[-1]
  bullets = []
  for variant in dict.fromkeys(v for v, _ in loss):
    own = [loss.get((variant, d)) for d in (shallow, deep)]
    ref = [loss.get(("preln", d)) for d in (shallow, deep)]
    parts = []
    if variant != "preln" and None not in own + ref:
      gaps = [o - r for o, r in zip(own, ref)]
      trend = "narrows" if abs(gaps[1]) < abs(gaps[0]) else "widens"
      side = lambda g: "behind" if g > 0 else "ahead of"
      parts.append(f"{abs(gaps[0]):.3f} {side(gaps[0])} Pre-LN at {shallow} layers, "
                   f"{abs(gaps[1]):.3f} {side(gaps[1])} at {deep}: the gap {trend} with depth")
    if None not in own:
      change = own[1] - own[0]
      parts.append(f"{deep} layers {'improve' if change < 0 else 'worsen'} its eval loss by "
                   f"{abs(change):.3f} over {shallow}")
    if parts:
      bullets.append(f"- `{variant}`: " + "; ".join(parts) + ".")
  return bullets


def report(results, scale, depths, command, missing, output, failed=None) -> str:
  r0 = results[0]
  loss = {(r["variant"], r["depth"]): r["final_eval_loss"] for r in results}
  rows = []
  for r in results:
    ref = loss.get(("preln", r["depth"]))
    shallow = loss.get((r["variant"], depths[0]))
    rows.append([f"`{r['variant']}`", r["depth"], f"{r['params']:,}",
                 f"{r['mlp_block_resid_gain']:.3g}", f"{r['tokens_per_s']:,.0f}",
                 f"{r['train_s'] / 60:.1f} min", f"{r['final_eval_loss']:.3f}",
                 f"{r['final_eval_loss'] - ref:+.3f}" if ref is not None and
                 r["variant"] != "preln" else "-",
                 f"{r['final_eval_loss'] - shallow:+.3f}" if r["depth"] != depths[0] and
                 shallow is not None else "-"])
  lines = [f"# Depth scaling of the decoder variants (`--scale={scale}`)", "",
           f"Command: `{command}`", "",
           f"Depths {list(depths)}; D={r0['model']['n_embd']}, H={r0['model']['n_head']}, "
           f"T={r0['model']['context_length']}, batch {r0['batch_size']}, {r0['steps']} steps, "
           f"on the embedded corpus (byte tokenizer). Final eval loss: the loop's last "
           f"evaluation ({r0['eval_steps']} validation batches, the same for every run); one "
           f"seed per run, so differences below the seed-to-seed spread that "
           f"`baseline_comparison` measures are noise. Tokens/s: median logged throughput "
           f"on a shared machine (rough).", ""]
  lines += report_lib.markdown_table(
      ["variant", "layers", "params", "MLP gain", "tokens/s", "train time", "final eval loss",
       "vs Pre-LN (same depth)", f"vs {depths[0]} layers"], rows) + [""]
  for depth in depths:
    series = {r["variant"]: r["history"] for r in results if r["depth"] == depth}
    if series:
      path = f"loss_vs_step_L{depth}.png"
      report_lib.plot_curves(series, os.path.join(output, path),
                             title=f"{depth} layers: train loss (lines), eval loss (dots)")
      lines += [f"![{depth} layers]({path})", ""]
  lines += ["## What this run shows", ""] + findings(loss, depths) + [""]
  lines += ["The paper (Sec. 5) trains 18 and 72 layers for 40K steps: its simplified blocks "
            "keep up with Pre-LN at both depths, and SAS(-P) gain more from depth than "
            "V-SkipInit. Short runs of narrow models are not that setting, and nothing here was "
            "tuned for it: every variant runs its config file's settings (the shaped-attention "
            "MLP gain rescaled with depth as stated above).", ""]
  if missing:
    lines += ["Not finished when the report was written: "
              + ", ".join(f"`{m}`" for m in missing) + ".", ""]
  lines += report_lib.failed_lines(failed or {})
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = report_lib.experiment_parser("depth_scaling", __doc__, SCALES, VARIANTS)
  parser.add_argument("--depths", default=None, help="two comma-separated layer counts "
                      "(default: the scale's)")
  parser.add_argument("--num_train_steps", type=int, default=None,
                      help="override the scale's step count (quick checks)")
  parser.add_argument("--no_scale_mlp_gain", action="store_true")
  args = parser.parse_args()
  output, workdir_root = report_lib.output_folders(args, "depth_scaling")
  depths = (tuple(int(d) for d in args.depths.split(",")) if args.depths
            else SCALES[args.scale]["depths"])
  extra = report_lib.parse_overrides(args.set)

  def runs():
    for depth in depths:
      for variant in args.variants.split(","):
        overrides = run_overrides(args.scale, variant, depth, not args.no_scale_mlp_gain,
                                  args.num_train_steps, extra)
        gain = report_lib.make_config(variant, SCALES[args.scale]["arg"],
                                      overrides).model.mlp_block_resid_gain
        yield (f"{variant}_L{depth}", report_lib.config_spec(variant, SCALES[args.scale]["arg"]),
               overrides, {"variant": variant, "depth": depth, "mlp_block_resid_gain": gain})

  trained = report_lib.train_planned(runs(), workdir_root, args.report_only, args.jobs)
  report_lib.require_results(trained)
  command = report_lib.command_line("depth_scaling", args, parser,
                                    ("variants", "depths", "num_train_steps",
                                     "no_scale_mlp_gain"))
  report_lib.write_runs_report(
      output, report(trained.results, args.scale, depths, command, trained.missing, output,
                     trained.failed),
      scale=args.scale, command=command, trained=trained,
      keep=("variant", "depth", "steps", "params", "mlp_block_resid_gain", "final_eval_loss",
            "final_train_loss", "tokens_per_s", "train_s"))
  report_lib.exit_if_failed(trained.failed)


if __name__ == "__main__":
  main()

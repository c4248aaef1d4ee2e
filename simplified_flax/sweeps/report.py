"""The sweep's report: `report.md`, `results.json` and the loss curves in a folder (local or
gs://), rendering comparison.py's numbers: per grid point the final eval loss over seeds
(mean ± sd), parameters, tokens/s, train time; the paired intervals against the reference;
with `best_of`, each variant at its own best value of that field.
"""
import json
import math
from typing import Sequence

from etils import epath

from simplified_flax.sweeps import baseline
from simplified_flax.sweeps import comparison
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import stats

PLOTS_NEED = "the plots need matplotlib (pip install 'simplified_flax[experiments]')"


def _fmt(value, digits=4, sign=False) -> str:
  if value is None:
    return "-"
  return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _mean_sd(values) -> str:
  mean, sd = stats.mean_std(values)
  if mean is None:
    return "-"
  n = len([v for v in values if v is not None])
  return f"{mean:.4f}" + (f" ± {sd:.4f}" if sd is not None else "") + f" (n={n})"


def _table(headers, rows) -> list[str]:
  lines = ["| " + " | ".join(headers) + " |",
           "| " + " | ".join(["---"] + ["---:"] * (len(headers) - 1)) + " |"]
  return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _interval_text(row) -> str:
  if row["low"] is None:
    return "-"
  return f"[{row['low']:+.4f}, {row['high']:+.4f}]"


def _point_text(point: dict) -> str:
  return ", ".join(f"{f}={plan.format_value(v)}" for f, v in point.items()) or "-"


def _unigram_text(unigrams) -> str:
  if not unigrams:
    return ("Unigram loss: not known (no run finished, or the data could not be read), so no "
            "run is held to it.")
  values = ", ".join(f"{u:.4f}" for u in unigrams)
  return (f"Unigram loss of the data: {values} nats per token (the training shards' token "
          "frequencies scored on the runs' eval batches: what a model that ignores its context "
          f"reaches). A run whose final eval loss is not below it by {baseline.LEARNED_MARGIN} "
          "did not learn; a grid point with such a run (or a failed or diverged one) gets the "
          "verdict \"did not learn\" and is never a best value.")


def markdown(collected, groups, tables, *, reference, best_of, command, plots,
             quantize=None, unigrams=(), extend: int = 0) -> str:
  """report.md's text; `tables` is comparison.tables(groups, reference, best_of)."""
  failed = [c for c in collected if c.error]
  missing = [c for c in collected if not c.summary and not c.error]
  lines = _header(collected, groups, command, unigrams, extend, failed, missing)
  lines += _points_section(tables["points"], quantize)
  if tables["paired"]:
    lines += _paired_section(tables["paired"], reference)
  if best_of:
    lines += _best_of_section(tables["best_of_rows"], reference, best_of, extend)
  lines += [
      "## Reading the intervals", "",
      "Each seed gives both variants the same data order and initialisation key, so the "
      "differences cancel what the seeds share. An interval that excludes 0 says the two "
      "variants are separated at this budget and scale; one that includes 0 says this many "
      "seeds cannot tell them apart (not that they are equal: more seeds narrow it). With "
      "several grid points or variants, about 1 in 20 intervals excludes 0 by chance.", ""]
  if failed:
    lines += ["## Failed runs", ""] + [f"- `{c.run.name}`: {c.error}" for c in failed] + [""]
  if missing:
    lines += ["## Not run yet", "", ", ".join(f"`{c.run.name}`" for c in missing)
              + ". Rerun the sweep command to train them.", ""]
  lines += ["## Curves", ""] + plots
  return "\n".join(lines) + "\n"


def _header(collected, groups, command, unigrams, extend, failed, missing) -> list[str]:
  """The title, the command, what finished, the unigram loss the runs are held to."""
  finished = [c for c in collected if c.summary]
  variants = list(dict.fromkeys(c.run.variant for c in collected))
  seeds = {c.run.seed for c in collected}
  points = {point for _, point in groups}
  return [f"# Sweep: {', '.join(variants)} × {len(points)} grid point(s)"
          + (" (with the extensions)" if extend else "") + f" × {len(seeds)} seed(s)", "",
          f"Command: `{command}`", "",
          f"{len(finished)} of {len(collected)} runs finished"
          + (f", {len(failed)} failed" if failed else "")
          + (f", {len(missing)} not run yet" if missing else "") + ". Final eval loss: each "
          "run's last evaluation (the same validation batches for every run). Tokens/s: the "
          "median logged training throughput, the first interval (compilation) left out.", "",
          _unigram_text(unigrams), ""]


def _points_section(rows, quantize) -> list[str]:
  """Per variant and grid point: loss over seeds, runs learned, size, speed, and the
  outlier-feature columns (the OP paper's) where the runs measured them."""
  extra = [(key, title) for key, title in (
      ("peak_kurtosis", "peak kurtosis"),
      ("quantized_loss_increase", f"{quantize} loss increase"))
           if any(r[key] is not None for r in rows)]
  explained = {"peak_kurtosis": "Peak kurtosis: the largest activation kurtosis of any layer "
                "over training (the diagnostics every `diagnostics_every` steps), mean over "
                "seeds.",
                "quantized_loss_increase": f"{quantize} loss increase: the final checkpoint's "
                "eval loss with int8 fake-quantised linear layers minus its full-precision one, "
                "mean over seeds."}
  lines = ["## Final eval loss per grid point", ""]
  if extra:
    lines += [" ".join(explained[key] for key, _ in extra), ""]
  return lines + _table(
      ["variant", "grid point", "final eval loss (mean ± sd)", "learned", "params",
       "tokens/s", "train time"] + [title for _, title in extra],
      [[f"`{r['variant']}`", _point_text(r["point"]),
        _mean_sd(list(r["final_eval_losses"].values())) if r["finished"] else "-",
        f"{r['learned']} of {r['finished'] + r['failed']}"
        if r["finished"] + r["failed"] else "-",
        f"{r['params']:,}" if r["params"] else "-",
        f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
        f"{r['train_s']:.0f} s" if r["train_s"] else "-"]
       + [_fmt(r[key], 3) if key == "peak_kurtosis"
          else "-" if r[key] is None else f"{r[key]:+.1e}" for key, _ in extra]
       for r in rows]) + [""]


def _paired_section(paired, reference) -> list[str]:
  return [f"## Against `{reference}`, paired by seed", "",
          f"Variant minus `{reference}` in final eval loss at the same grid point: the mean "
          "of the per-seed differences and its 95% t-interval. Negative: lower loss than "
          f"`{reference}`.", ""] + _table(
              ["variant", "grid point", "seeds", "mean difference", "95% interval", "verdict"],
              [[f"`{r['variant']}`", _point_text(r["point"]), r["n"],
                _fmt(r["mean_difference"], sign=True), _interval_text(r), r["verdict"] or "-"]
               for r in paired]) + [""]


def _best_text(r) -> str:
  if r["best"] is None:
    return "none learned"
  return plan.format_value(r["best"]) + (" (edge)" if r["best_at_grid_edge"] else "")


def _best_of_section(best, reference, best_of, extend) -> list[str]:
  intro = (f"The value of `{best_of}` with the lowest mean final eval loss over seeds among "
           "the values where every seed learned, and the difference to "
           f"`{reference}` at its own best, paired by seed. \"unbracketed\": a best value "
           "that is the smallest or largest value the variant's runs tried (of either "
           "side), so a value beyond it may be better still: no higher or lower is read "
           "from it." + (f" The sweep added up to {extend} value(s) beyond an edge best, one "
                         "grid step at a time, before reporting (\"tried\" lists them)."
                         if extend else ""))
  return [f"## Each variant at its own best `{best_of}`", "", intro, ""] + _table(
      ["variant", "other grid fields", f"best {best_of}", "tried", "final eval loss",
       f"minus `{reference}`", "95% interval", "verdict"],
      [[f"`{r['variant']}`", _point_text(r["point"]), _best_text(r),
        ", ".join(plan.format_value(v) for v in r["tried"]), _fmt(r["final_eval_loss_mean"]),
        "-" if r["is_reference"] else _fmt(r["mean_difference"], sign=True),
        "-" if r["is_reference"] else _interval_text(r),
        ("reference" + (f" ({r['verdict']})" if r["verdict"] else ""))
        if r["is_reference"] else r["verdict"] or "-"] for r in best]) + [""]


def _band(histories: Sequence[list[dict]], x: str):
  """(xs, mean, low, high) of the train loss at the steps every seed logged."""
  steps = None
  for rows in histories:
    have = {r["step"] for r in rows if "loss" in r}
    steps = have if steps is None else steps & have
  steps = sorted(steps or ())
  by_step = [{r["step"]: r for r in rows if "loss" in r} for rows in histories]
  xs, mean, low, high = [], [], [], []
  for step in steps:
    values = [h[step]["loss"] for h in by_step]
    xs.append(sum(h[step][x] for h in by_step) / len(by_step) if x != "step" else step)
    mean.append(sum(values) / len(values))
    low.append(min(values))
    high.append(max(values))
  return xs, mean, low, high


def plot(groups, output: epath.Path) -> list[str]:
  """Loss vs step and vs wall time at each grid point: a line per variant (mean over seeds),
  the seeds' range as a band. Returns the report's image lines."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return [f"No plots: {PLOTS_NEED}.", ""]
  import io  # pylint: disable=import-outside-toplevel
  points = list(dict.fromkeys(point for _, point in groups))
  lines = []
  for index, point in enumerate(points):
    for x, label, stem in (("step", "step", "step"), ("elapsed_s", "wall-clock seconds", "time")):
      fig, ax = plt.subplots(figsize=(8, 5))
      for (variant, p), group in groups.items():
        histories = [c.summary["history"] for c in group if p == point and c.summary]
        if not histories:
          continue
        xs, mean, low, high = _band(histories, x)
        line, = ax.plot(xs, mean, label=f"{variant} (n={len(histories)})", linewidth=1.2)
        if len(histories) > 1:
          ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
      ax.set_xlabel(label)
      ax.set_ylabel("train loss (nats / token)")
      ax.set_title(f"train loss, mean over seeds (band: their range); {_point_text(dict(point))}")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
      fig.tight_layout()
      name = f"loss_vs_{stem}_{index}.png"
      buffer = io.BytesIO()
      fig.savefig(buffer, format="png", dpi=110)
      plt.close(fig)
      (output / name).write_bytes(buffer.getvalue())
      lines += [f"![loss vs {stem}, {_point_text(dict(point))}]({name})", ""]
  return lines


def _json_safe(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  return value


def write(runs: Sequence[plan.Run], output: str, *, command: str, reference: str | None = None,
          best_of: str | None = None, failed: dict[str, str] | None = None,
          quantize: str | None = None, baselines: baseline.Baselines | None = None,
          extend: int = 0) -> list[comparison.Collected]:
  """Writes `<output>/report.md`, `results.json` and the PNGs (local or gs://); returns the
  collected runs. `reference` defaults to the first variant; `baselines`: the unigram losses
  the runs are held to (default: computed from the runs' data)."""
  collected = comparison.collect(runs, failed, quantize, baselines or baseline.Baselines())
  reference = reference or runs[0].variant
  groups = comparison.groups(collected)
  folder = epath.Path(output)
  folder.mkdir(parents=True, exist_ok=True)
  image_lines = plot(groups, folder) if any(c.summary for c in collected) else []
  tables = comparison.tables(groups, reference, best_of)
  unigrams = sorted({c.unigram for c in collected if c.unigram is not None})
  (folder / "report.md").write_text(markdown(collected, groups, tables, reference=reference,
                                             best_of=best_of, command=command,
                                             plots=image_lines, quantize=quantize,
                                             unigrams=unigrams, extend=extend))
  data = {"command": command, "reference": reference, "best_of": best_of, "extend": extend,
          "unigram_cross_entropy": unigrams, "learned_margin": baseline.LEARNED_MARGIN,
          "runs": [{"name": c.run.name, "variant": c.run.variant, "point": dict(c.run.point),
                    "seed": c.run.seed, "workdir": c.run.workdir, "status": c.status,
                    "unigram_cross_entropy": c.unigram, "error": c.error,
                    **({k: c.summary[k] for k in ("steps", "params", "final_eval_loss",
                                                  "final_train_loss", "tokens_per_s", "train_s",
                                                  "peak_kurtosis", "quantized_loss_increase")}
                       if c.summary else {})} for c in collected], **tables}
  (folder / "results.json").write_text(json.dumps(_json_safe(data), indent=2))
  return collected

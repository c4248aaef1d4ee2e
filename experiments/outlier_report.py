"""The report of experiments/outlier_features.py: tables, kurtosis plots and what they show,
built from the runs' summaries alone (no JAX)."""
import math
import os
from typing import Any, Mapping, Sequence

from experiments import report_lib

KURTOSIS_RATIO_TARGET = 5.0   # Pre-LN / OP peak kurtosis (AdamW) the paper's result implies
W8A8_RATIO_TARGET = 3.0       # Pre-LN / OP W8A8 eval-loss increase (AdamW)
LABELS = {"preln": "Pre-LN", "op": "OP", "sas_p": "SAS-P", "adamw": "AdamW", "muon": "Muon"}


def label(run: Mapping[str, Any]) -> str:
  name = lambda key: LABELS.get(run[key], run[key])
  return f"{name('variant')} + {name('optimizer')}"


def _num(value, digits: int = 3) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "-"
  return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"


def ratio(a, b) -> float | None:
  """a / b, None when either is missing or b is not positive."""
  if a is None or b is None or b <= 0:
    return None
  return a / b


def run_rows(runs: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  rows = []
  for r in runs:
    if r.get("diverged"):
      rows.append([label(r), "diverged"] + ["-"] * 7)
      continue
    rows.append([label(r), _num(r.get("fp_eval_loss")), _num(r.get("peak_kurtosis"), 2),
                 _num(r.get("final_kurtosis"), 2), _num(r.get("peak_max_median"), 1),
                 _num(r.get("final_max_median"), 1), _num(r.get("w8a8_eval_loss")),
                 f"{r['w8a8_increase']:+.4f}" if r.get("w8a8_increase") is not None else "-",
                 _num(r.get("train_s", 0) / 60, 1)])
  return rows


RUN_HEADERS = ["run", "eval loss", "peak kurtosis", "final kurtosis", "peak max/median",
               "final max/median", "W8A8 eval loss", "W8A8 increase", "train min"]


def sweep_rows(sweep: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  rows = []
  for r in sorted(sweep, key=lambda r: (r["variant"], r["learning_rate"])):
    if r.get("diverged"):
      rows.append([label(r), f"{r['learning_rate']:g}", "diverged", "-", "-", "-"])
      continue
    rows.append([label(r), f"{r['learning_rate']:g}", _num(r.get("fp_eval_loss")),
                 _num(r.get("peak_kurtosis"), 2), _num(r.get("final_kurtosis"), 2),
                 f"{r['w8a8_increase']:+.4f}" if r.get("w8a8_increase") is not None else "-"])
  return rows


def plots(runs, sweep, output: str) -> list[str]:
  """Writes the kurtosis plots; returns their markdown lines."""
  lines = []
  for r in runs:
    rows = [h for h in r.get("history", ()) if any(k.startswith("kurtosis/") for k in h)]
    if not rows:
      continue
    layers = sorted({int(k.split("_")[-1]) for k in rows[0] if k.startswith("kurtosis/")})
    series = {f"layer {l}": [{"step": h["step"], "kurtosis": h[f"kurtosis/layer_{l}"]}
                             for h in rows] for l in layers}
    path = f"kurtosis_{r['variant']}_{r['optimizer']}.png"
    report_lib.plot_curves(series, os.path.join(output, path), y="kurtosis", eval_y=None,
                           title=f"{label(r)} (lr {r['learning_rate']:g}): kurtosis per layer",
                           ylabel="kurtosis (var of neuron mean square)", yscale="log")
    lines.append(f"![{label(r)}]({path})")
  every = {label(r): [{"step": s, "kurtosis": k} for s, k in
                      zip(r.get("kurtosis_steps", ()), r.get("kurtosis_max_layer", ()))]
           for r in runs if r.get("kurtosis_steps")}
  if every:
    styles = {label(r): {"linestyle": "-" if r["optimizer"] == "adamw" else "--"} for r in runs}
    report_lib.plot_curves(every, os.path.join(output, "kurtosis_all.png"), y="kurtosis",
                           eval_y=None, title="Largest kurtosis over layers (AdamW solid, "
                           "Muon dashed)", ylabel="max over layers of kurtosis", yscale="log",
                           styles=styles)
    lines.insert(0, "![every run](kurtosis_all.png)")
  finished = [r for r in sweep if r.get("peak_kurtosis") is not None]
  if finished:
    series = {}
    for r in sorted(finished, key=lambda r: r["learning_rate"]):
      series.setdefault(label(r), []).append({"lr": r["learning_rate"],
                                              "kurtosis": r["peak_kurtosis"]})
    report_lib.plot_curves(series, os.path.join(output, "lr_sweep.png"), x="lr",
                           y="kurtosis", eval_y=None, xlabel="learning rate",
                           title="Peak kurtosis against learning rate (AdamW)",
                           ylabel="peak kurtosis (max over layers and steps)", xscale="log",
                           yscale="log", marker="o")
    lines.append("![sweep](lr_sweep.png)")
  return lines


def _find(runs, variant, optimizer):
  return next((r for r in runs if r["variant"] == variant and r["optimizer"] == optimizer
               and not r.get("diverged")), None)


def paper_checks(runs) -> list[str]:
  """The two figures the paper's claim turns on (Pre-LN over OP with AdamW), against targets."""
  preln, op = _find(runs, "preln", "adamw"), _find(runs, "op", "adamw")
  if preln is None or op is None:
    return ["- Pre-LN + AdamW or OP + AdamW did not finish: no comparison."]
  kurt = ratio(preln.get("peak_kurtosis"), op.get("peak_kurtosis"))
  paper_units = ratio(1 + preln.get("peak_kurtosis", 0), 1 + op.get("peak_kurtosis", 0))
  quant = ratio(preln.get("w8a8_increase"), op.get("w8a8_increase"))
  met = lambda value, target: ("meets" if value is not None and value >= target
                               else "does not meet")
  return [
      f"- Peak kurtosis, Pre-LN / OP (AdamW): **{_num(kurt, 1)}x** "
      f"({met(kurt, KURTOSIS_RATIO_TARGET)} the {KURTOSIS_RATIO_TARGET:g}x target); in the "
      f"paper's units Kurt = 1 + kurtosis, {_num(paper_units, 1)}x.",
      f"- W8A8 eval-loss increase, Pre-LN / OP (AdamW): **{_num(quant, 1)}x** "
      f"({met(quant, W8A8_RATIO_TARGET)} the {W8A8_RATIO_TARGET:g}x target; "
      f"{preln['w8a8_increase']:+.4f} vs {op['w8a8_increase']:+.4f} nats)."]


def agreement(runs) -> tuple[list[str], list[str]]:
  """(where the run agrees with the paper, where it does not), one clause each."""
  agrees, differs = [], []
  preln, op = _find(runs, "preln", "adamw"), _find(runs, "op", "adamw")
  if preln and op:
    trend = lambda r: r["kurtosis_max_layer"][-1] - r["kurtosis_max_layer"][0]
    (agrees if trend(preln) > 0 >= trend(op) else differs).append(
        f"Pre-LN + AdamW's kurtosis {'rises' if trend(preln) > 0 else 'does not rise'} over "
        f"training ({preln['kurtosis_max_layer'][0]:.2f} -> {preln['final_kurtosis']:.2f}) and "
        f"OP's {'falls' if trend(op) <= 0 else 'rises'} ({op['kurtosis_max_layer'][0]:.2f} -> "
        f"{op['final_kurtosis']:.2f}); at the last step Pre-LN's is "
        f"{_num(ratio(preln['final_kurtosis'], op['final_kurtosis']), 1)}x OP's")
    kurt = ratio(preln["peak_kurtosis"], op["peak_kurtosis"])
    (agrees if (kurt or 0) >= KURTOSIS_RATIO_TARGET else differs).append(
        f"peak kurtosis Pre-LN / OP is {_num(kurt, 1)}x (target {KURTOSIS_RATIO_TARGET:g}x)")
    quant = ratio(preln["w8a8_increase"], op["w8a8_increase"])
    (agrees if (quant or 0) >= W8A8_RATIO_TARGET else differs).append(
        f"W8A8 costs Pre-LN {_num(quant, 1)}x what it costs OP (target {W8A8_RATIO_TARGET:g}x)")
  finished = [r for r in runs if r.get("w8a8_increase") is not None]
  if finished:
    worst = max(abs(r["w8a8_increase"]) for r in finished)
    spread = max(r.get("peak_max_median", 0.0) for r in finished)
    if worst < 0.01:
      differs.append(f"int8 costs every run at most {worst:.4f} nats, far from the paper's "
                     f"damage: the largest max/median ratio here is {spread:.1f}, which a "
                     f"per-tensor int8 grid still resolves")
  pairs = [(_find(runs, v, "adamw"), _find(runs, v, "muon")) for v in LABELS if v in
           {r["variant"] for r in runs}]
  pairs = [(a, m) for a, m in pairs if a and m]
  if pairs:
    lower = sum(m["peak_kurtosis"] < a["peak_kurtosis"] for a, m in pairs)
    (agrees if lower == len(pairs) else differs).append(
        f"Muon lowers the peak kurtosis of {lower} of {len(pairs)} blocks")
  return agrees, differs


def sweep_checks(sweep, trains_within: float) -> list[str]:
  """The two ratios at every swept rate, and whether both blocks train there: where the
  paper's result could show at this scale, if anywhere."""
  best = {}
  for r in sweep:
    if r.get("fp_eval_loss") is not None:
      best[r["variant"]] = min(best.get(r["variant"], math.inf), r["fp_eval_loss"])
  trains = lambda r: r.get("fp_eval_loss") is not None and (
      r["fp_eval_loss"] <= best[r["variant"]] + trains_within)
  rows, both = [], []
  for lr in sorted({r["learning_rate"] for r in sweep}):
    at = {r["variant"]: r for r in sweep if r["learning_rate"] == lr}
    preln, op = at.get("preln"), at.get("op")
    if not (preln and op and preln.get("peak_kurtosis") is not None
            and op.get("peak_kurtosis") is not None):
      continue
    kurt = ratio(preln["peak_kurtosis"], op["peak_kurtosis"])
    quant = ratio(preln["w8a8_increase"], op["w8a8_increase"])
    trained = trains(preln) and trains(op)
    met = (kurt or 0) >= KURTOSIS_RATIO_TARGET and (quant or 0) >= W8A8_RATIO_TARGET
    if met and trained:
      both.append(f"{lr:g}")
    rows.append([f"{lr:g}", _num(kurt, 1), _num(quant, 1), "yes" if trains(preln) else "no",
                 "yes" if trains(op) else "no"])
  lines = report_lib.markdown_table(["lr", "peak kurtosis Pre-LN / OP", "W8A8 increase "
                                     "Pre-LN / OP", "Pre-LN trains", "OP trains"], rows)
  verdict = (f"Both targets are met, with both blocks training, at {', '.join(both)}."
             if both else "At no swept rate are both targets met with both blocks training.")
  return lines + ["", verdict]


def findings(runs, sweep, trains_within: float = math.inf) -> list[str]:
  """Each claim of the paper, stated as measured here."""
  out = []
  by_variant = {}
  for r in sweep:
    if r.get("peak_kurtosis") is not None:
      by_variant.setdefault(r["variant"], []).append(r)
  for variant, rs in sorted(by_variant.items()):
    rs.sort(key=lambda r: r["learning_rate"])
    best = min(r["fp_eval_loss"] for r in rs)
    failed = [r for r in rs if r["fp_eval_loss"] > best + trains_within]
    if failed:
      out.append(f"- {LABELS.get(variant, variant)} + AdamW does not train at "
                 + ", ".join(f"{r['learning_rate']:g} (eval loss {r['fp_eval_loss']:.3f})"
                             for r in failed)
                 + f": more than {trains_within:g} nats behind its best, {best:.3f}.")
    peaks = [r["peak_kurtosis"] for r in rs]
    if len(peaks) < 2:
      continue
    trend = ("grows with every step up in learning rate" if all(
        b > a for a, b in zip(peaks, peaks[1:])) else "does not grow monotonically with "
             "learning rate")
    out.append(f"- {LABELS.get(variant, variant)} + AdamW: peak kurtosis "
               + ", ".join(f"{p:.2f} at {r['learning_rate']:g}" for p, r in zip(peaks, rs))
               + f": it {trend} (paper: outliers grow with learning rate).")
  for variant in ("preln", "op", "sas_p"):
    adam, muon = _find(runs, variant, "adamw"), _find(runs, variant, "muon")
    if adam and muon:
      lower = ("lower, as" if muon["peak_kurtosis"] < adam["peak_kurtosis"]
               else "not lower, unlike")
      out.append(f"- {LABELS[variant]}: Muon's peak kurtosis {muon['peak_kurtosis']:.2f} vs "
                 f"AdamW's {adam['peak_kurtosis']:.2f} ({lower} the paper's non-diagonal "
                 f"preconditioning); W8A8 increase "
                 f"{muon['w8a8_increase']:+.4f} vs {adam['w8a8_increase']:+.4f}; eval loss "
                 f"{muon['fp_eval_loss']:.3f} vs {adam['fp_eval_loss']:.3f}.")
  sasp, preln = _find(runs, "sas_p", "adamw"), _find(runs, "preln", "adamw")
  if sasp and preln:
    out.append(f"- SAS-P + AdamW: peak kurtosis {sasp['peak_kurtosis']:.2f} vs Pre-LN's "
               f"{preln['peak_kurtosis']:.2f}, W8A8 increase {sasp['w8a8_increase']:+.4f} vs "
               f"{preln['w8a8_increase']:+.4f}.")
  finished = [r for r in runs if r.get("peak_kurtosis") is not None]
  if len(finished) >= 3:
    rank = lambda xs: [sorted(xs).index(x) for x in xs]
    a = rank([r["peak_kurtosis"] for r in finished])
    b = rank([r["w8a8_increase"] for r in finished])
    n = len(a)
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))
    out.append(f"- Across the {n} runs, the rank correlation of peak kurtosis with the W8A8 "
               f"increase is {rho:+.2f} (paper: more outliers, more damage at int8).")
  return out


def report(runs, sweep, lr, scale, command, missing, output, trains_within,
           picked: bool = True) -> str:
  """report.md's text; writes the plots into `output`. `picked`: the sweep chose `lr` (else
  `--lr` gave it)."""
  r0 = next((r for r in runs + sweep if r.get("model")), None)
  lines = [f"# Outlier features, optimisers and W8A8 (`--scale={scale}`)", "",
           f"Command: `{command}`", ""]
  if r0:
    m = r0["model"]
    lines += [f"Settings: L={m['n_layer']}, D={m['n_embd']}, H={m['n_head']}, "
              f"T={m['context_length']}, batch {r0['batch_size']}, {r0['steps']} steps per "
              f"run, the configs' linear schedule and warm-up, weight decay and clipping; "
              f"one seed (same data, order and initialisation seed for every run) on the "
              f"embedded corpus (byte tokenizer). Learning rate of the comparison: **{lr:g}** "
              + (f"(picked by the sweep below: the rate with the largest Pre-LN + AdamW peak "
                 f"kurtosis among those where its eval loss is within {trains_within:g} nats "
                 f"of its best). " if picked else "(given by `--lr`). ")
              + f"Kurtosis: the project's `kurtosis/layer_<l>` diagnostic of each "
              f"block's output (var over neurons of the normalised mean square = the paper's "
              f"Kurt - 1), on the training batch every few steps; peak = the largest over "
              f"layers and steps, final = largest over layers at the last step. Max/median: "
              f"mean over tokens of max |x| / median |x| over neurons. W8A8: every linear "
              f"layer's weights (per output channel) and inputs (per tensor) fake-quantised to "
              f"symmetric int8, eval loss on the same {r0['eval_steps']} validation batches as "
              f"the full-precision loss.", ""]
  lines += ["## At the chosen learning rate", ""]
  lines += report_lib.markdown_table(RUN_HEADERS, run_rows(runs)) + [""]
  agrees, differs = agreement(runs)
  lines += ["Agrees with the paper: " + ("; ".join(agrees) or "nothing measured") + ".", "",
            "Does not agree: " + ("; ".join(differs) or "nothing measured") + ".", ""]
  lines += ["## The paper's two figures", ""] + paper_checks(runs) + [""]
  lines += ["## Learning-rate sweep (AdamW)", ""]
  lines += report_lib.markdown_table(["run", "lr", "eval loss", "peak kurtosis",
                                      "final kurtosis", "W8A8 increase"],
                                     sweep_rows(sweep)) + [""]
  lines += ["The paper's two ratios at each rate (AdamW; a block 'trains' when its eval loss is "
            f"within {trains_within:g} nats of its best over the sweep):", ""]
  lines += sweep_checks(sweep, trains_within) + [""]
  lines += ["## What this run shows", ""] + (findings(runs, sweep, trains_within) or [
      "- Nothing beyond the tables (one rate, one optimiser)."]) + [""]
  size = (f"a {r0['model']['n_layer']}-layer, {r0['model']['n_embd']}-wide model trains for "
          f"{r0['steps']} steps" if r0 else "nothing trained")
  lines += ["The paper trains 130M-1.2B-parameter models for thousands of steps, where Pre-LN's "
            f"kurtosis climbs to the hundreds; here {size}, so every figure above is one seed "
            "of a much smaller setting. `--scale=paper` runs the configs' own shape (L=18, "
            "D=768, batch 128, 40K steps) with the same sweep and report.", ""]
  lines += plots(runs, sweep, output) + [""]
  if missing:
    lines += ["Not finished when the report was written: "
              + ", ".join(f"`{m}`" for m in missing) + ".", ""]
  return "\n".join(lines) + "\n"

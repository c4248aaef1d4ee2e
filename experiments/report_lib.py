"""What every experiment script shares: configs with overrides, a run's summary, plots, tables.

    config = report_lib.make_config("sas_p", "cpu", {"model.n_layer": 4, "num_train_steps": 200})
    summary = report_lib.train_run(config, workdir)      # resumes; skips a finished run
    report_lib.plot_curves({"sas_p": summary["history"]}, "loss.png", x="step")
    report_lib.markdown_table(["variant", "loss"], [["sas_p", "2.31"]])

A run's summary comes from its workdir alone (`config.json` + `metrics.jsonl`), so a report can
be rebuilt from finished workdirs without training anything. Workdirs and report folders are
read and written through `etils.epath`, so either may be `gs://...` (docs/distributed.md,
"Remote workdirs").
"""
import argparse
import ast
import json
import os
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from etils import epath
import numpy as np

import configs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ configs

def parse_overrides(pairs: Sequence[str]) -> Dict[str, Any]:
  """["model.n_layer=2", "data.name='text_files'"] -> {"model.n_layer": 2, ...} (values are
  Python literals; anything else stays a string). The scripts' `--set` flag."""
  out = {}
  for pair in pairs or ():
    key, sep, text = pair.partition("=")
    if not sep:
      raise ValueError(f"--set takes KEY=VALUE, got {pair!r}")
    try:
      out[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[key] = text
  return out


def make_config(variant: str, arg: str, overrides: Mapping[str, Any]):
  """`configs/<variant>.py` with switches `arg` (e.g. "cpu"), then dotted `overrides`."""
  return configs.load(f"{variant}:{arg}", overrides)


# --------------------------------------------------------------------------------- runs

def is_finished(workdir: str, num_train_steps: int) -> bool:
  """Whether the workdir's history reaches its last step's eval (the loop's final row)."""
  from simplified_flax.runs import metrics_io  # pylint: disable=import-outside-toplevel
  rows = metrics_io.read_history(os.path.join(workdir, metrics_io.METRICS_FILE))
  return any(r.get("step") == num_train_steps and "eval_loss" in r for r in rows)


class RunInterrupted(SystemExit):
  """A training run stopped before its last step (SIGTERM, preemption) with its checkpoint
  saved: the script stops too, rather than report a half-trained model or start the next run."""


def train_to_end(config, workdir: str):
  """`train.train_and_evaluate(config, workdir)` (resuming if a checkpoint is there); its final
  state, or RunInterrupted if the run stopped early."""
  from simplified_flax import train  # pylint: disable=import-outside-toplevel  (jax: slow)
  state = train.train_and_evaluate(config, workdir, tensorboard=False)
  if not is_finished(workdir, config.num_train_steps):
    raise RunInterrupted(f"{workdir} stopped before step {config.num_train_steps} (SIGTERM or "
                         "preemption; its checkpoint is saved). Run the same command again to "
                         "resume it and the runs after it.")
  return state


def train_run(config, workdir: str) -> Dict[str, Any]:
  """Trains `config` in `workdir` unless already finished there; returns `summarise(workdir)`."""
  if not is_finished(workdir, config.num_train_steps):
    train_to_end(config, workdir)
  return summarise(workdir)


def count_params(config_dict: Mapping[str, Any]) -> int:
  from simplified_flax.model import parameters  # pylint: disable=import-outside-toplevel
  return int(sum(np.prod(s) for s in parameters.parameter_shapes(dict(config_dict)).values()))


def summarise(workdir: str) -> Dict[str, Any]:
  """Final eval loss, throughput, train time and parameter count of a finished run."""
  from simplified_flax.runs import metrics_io  # pylint: disable=import-outside-toplevel
  config_dict = json.loads((epath.Path(workdir) / "config.json").read_text())
  history = metrics_io.read_history(os.path.join(workdir, metrics_io.METRICS_FILE))
  train_rows = [r for r in history if "loss" in r]
  evals = [r for r in history if "eval_loss" in r]
  # The first interval holds compilation: left out unless it is the only one.
  speeds = [r["tokens_per_s"] for r in train_rows[1:]] or [r["tokens_per_s"] for r in train_rows]
  tail = [r["loss"] for r in train_rows[-5:]]
  return {
      "workdir": workdir, "steps": config_dict["num_train_steps"],
      "params": count_params(config_dict),
      "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
      "final_train_loss": float(np.mean(tail)) if tail else None,
      "tokens_per_s": float(np.median(speeds)) if speeds else None,
      "train_s": train_rows[-1]["elapsed_s"] if train_rows else None,
      "history": history,
  }


# ------------------------------------------------------------------------------- numbers

def mean_spread(values: Sequence[float], digits: int = 3) -> str:
  """"2.345" for one value; "2.345 ± 0.012 (n=2)" with the half-range (n=2) or std (n>2)."""
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  spread = (max(values) - min(values)) / 2 if len(values) == 2 else statistics.stdev(values)
  return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f} (n={len(values)})"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: str | None = None) -> List[str]:
  """Lines of a markdown table; `align` is one char per column, "l" or "r" (default: l, r...)."""
  align = align or "l" + "r" * (len(headers) - 1)
  rule = ["---" if a == "l" else "---:" for a in align]
  lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return lines


# --------------------------------------------------------------------------------- plots

def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_curves(series: Mapping[str, Sequence[Mapping[str, float]]], path: str, *,
                x: str = "step", y: str = "loss", eval_y: str | None = "eval_loss",
                title: str = "", xlabel: str | None = None,
                ylabel: str = "cross-entropy (nats / token)", styles: Mapping[str, dict] = None,
                xscale: str = "linear", yscale: str = "linear", marker: str | None = None
                ) -> None:
  """One line per named history (rows with `x` and `y`), eval rows as markers on the same
  colour. `styles` maps a name to matplotlib keyword arguments (colour, linestyle, a marker of
  its own); `marker` marks every point of the other lines too (e.g. "o" for a few points)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  for name, history in series.items():
    style = {"marker": marker, "markersize": 4, **(styles or {}).get(name, {})}
    rows = [r for r in history if y in r and x in r]
    line, = ax.plot([r[x] for r in rows], [r[y] for r in rows], label=name, alpha=0.8,
                    linewidth=1.2, **style)
    if eval_y:
      # Eval rows carry no elapsed time: place them at their step's train row.
      at = {r["step"]: r[x] for r in rows}
      evals = [(at[r["step"]], r[eval_y]) for r in history if eval_y in r and r["step"] in at]
      if evals:
        ax.plot(*zip(*evals), "o", color=line.get_color(), markersize=4)
  ax.set_xscale(xscale)
  ax.set_yscale(yscale)
  ax.set_xlabel(xlabel or x)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  save_figure(fig, path, dpi=110)


def plot_bars(values: Mapping[str, float], path: str, *, title: str, ylabel: str,
              reference: float | None = None) -> None:
  """A bar per name (e.g. relative throughput), with an optional horizontal reference line."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4))
  names = list(values)
  ax.bar(names, [values[n] for n in names], color="tab:blue", alpha=0.8)
  if reference is not None:
    ax.axhline(reference, color="black", linewidth=0.8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.tick_params(axis="x", rotation=30)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  save_figure(fig, path, dpi=110)


def save_figure(fig, path: str, dpi: int) -> None:
  """Saves (then closes) a matplotlib figure as a PNG at any epath location."""
  import io  # pylint: disable=import-outside-toplevel
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  plt.close(fig)
  epath.Path(path).write_bytes(buffer.getvalue())


def write_text(path: str, text: str) -> None:
  """Writes a report file at any epath location (a local or gs:// folder)."""
  epath.Path(path).write_text(text)


def write_json(path: str, obj: Any) -> None:
  write_text(path, json.dumps(obj, indent=2))


# ------------------------------------------------------------------------------- scripts

def experiment_parser(experiment: str, doc: str, scales: Iterable[str], variants: Sequence[str],
                      *, workdirs: bool = True, report_only: bool = True):
  """The flags every experiment script shares: --scale, --output, --variants, --set and, for
  scripts that train, --workdir_root and (when they can report unfinished runs) --report_only."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--scale", choices=sorted(scales), default="cpu")
  parser.add_argument("--output", default=None, help="report folder (default "
                      f"experiments/results/<scale>/{experiment})")
  if workdirs:
    parser.add_argument("--workdir_root", default=None,
                        help=f"training workdirs (default workdirs/{experiment}_<scale>)")
  parser.add_argument("--variants", default=",".join(variants))
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="config override applied to every run (repeatable), e.g. "
                      "--set=model.n_layer=2")
  if report_only:
    parser.add_argument("--report_only", action="store_true",
                        help="train nothing: report the runs that have finished")
  return parser


def output_folders(args, experiment: str) -> tuple[str, str | None]:
  """(report folder, created if missing; training workdir root or None) of parsed `args`."""
  output = args.output or os.path.join(REPO_ROOT, "experiments", "results", args.scale,
                                       experiment)
  epath.Path(output).mkdir(parents=True, exist_ok=True)
  workdir_root = None
  if hasattr(args, "workdir_root"):
    workdir_root = args.workdir_root or os.path.join(REPO_ROOT, "workdirs",
                                                     f"{experiment}_{args.scale}")
  return output, workdir_root


def command_line(experiment: str, args, parser, flags: Sequence[str]) -> str:
  """The command that reproduces this report: the scale, each of `flags` that differs from
  its default, every --set."""
  text = f"python experiments/{experiment}.py --scale={args.scale}"
  for flag in flags:
    value = getattr(args, flag)
    if value is True:
      text += f" --{flag}"
    elif value and value != parser.get_default(flag):
      text += f" --{flag}={value}"
  return text + "".join(f" --set={o}" for o in getattr(args, "set", ()))


def train_planned(runs: Iterable[tuple[str, Any, Mapping[str, Any]]], workdir_root: str,
                  report_only: bool) -> tuple[List[Dict[str, Any]], List[str]]:
  """Trains (or, with `report_only`, only collects) each (name, config, fields) run in
  `<workdir_root>/<name>`. Returns (summaries of finished runs with `fields` added, names of
  runs not finished)."""
  results, missing = [], []
  for name, config, fields in runs:
    workdir = os.path.join(workdir_root, name)
    if report_only and not is_finished(workdir, config.num_train_steps):
      missing.append(name)
      continue
    print(f"== {name} ({config.num_train_steps} steps)", flush=True)
    summary = train_run(config, workdir)
    results.append({**summary, **fields, "batch_size": config.batch_size,
                    "eval_steps": config.eval_steps, "model": config.model.to_dict()})
    print(f"{name}: final eval loss {summary['final_eval_loss']:.4f}", flush=True)
  return results, missing


def write_report(output: str, text: str, results: Any) -> None:
  """`<output>/report.md` and `<output>/results.json`."""
  write_text(os.path.join(output, "report.md"), text)
  write_json(os.path.join(output, "results.json"), results)


def write_runs_report(output: str, text: str, *, scale: str, command: str, missing: List[str],
                      runs: Sequence[Mapping[str, Any]], keep: Sequence[str]) -> None:
  """`write_report` of a `train_planned` experiment: results.json holds the scale, command,
  unfinished runs and the `keep` fields of every finished run."""
  write_report(output, text, {"scale": scale, "command": command, "missing": missing,
                              "runs": [{k: r[k] for k in keep} for r in runs]})
  print(f"Wrote {output}/report.md, its plots and results.json")

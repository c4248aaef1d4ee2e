"""What every experiment script shares: its runs, configs with overrides, plots, tables.

    trained = report_lib.train_planned(
        [("sas_p_L4", "sas_p:cpu", {"model.n_layer": 4, "num_train_steps": 200}, {"depth": 4})],
        workdir_root, report_only=False, jobs=1)   # skips finished runs, resumes the others
    report_lib.plot_curves({"sas_p": trained.results[0]["history"]}, "loss.png", x="step")
    report_lib.markdown_table(["variant", "loss"], [["sas_p", "2.31"]])

Every run is a `python -m simplified_flax.train` command run by the sweep package
(`simplified_flax.sweeps.execute.run_all`, `--jobs` at a time, logs in `<workdir_root>/logs`);
its summary (`sweeps.results.summarise`) comes from its workdir alone (`config.json` +
`metrics.jsonl`), so a report can be rebuilt from finished workdirs without training anything.
Workdirs and report folders are read and written through `etils.epath`, so either may be
`gs://...` (docs/distributed.md, "Remote workdirs").
"""
import argparse
import ast
import dataclasses
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from etils import epath

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

# Every run is a `python -m simplified_flax.train` command executed by the sweep package
# (simplified_flax/sweeps, docs/sweeps.md): `execute.run_all` is the one loop over runs; a
# run's summary is `sweeps.results.summarise` of its workdir.

INTERRUPTED = ("Stopped before every run finished (SIGTERM or Ctrl-C): every finished run and "
               "every stopped run's checkpoint stays; rerun the same command to resume.")


class RunInterrupted(SystemExit):
  """The runs were stopped (SIGTERM, preemption, Ctrl-C) with their checkpoints saved: the
  script stops too (exit status 0) rather than report half-trained models."""


def config_spec(variant: str, arg: str) -> str:
  """The train command's `--config`: "sas_p:cpu", or "sas_p" without switches."""
  return f"{variant}:{arg}" if arg else variant


@dataclasses.dataclass
class Trained:
  """What `train_planned` gives back: summaries of the finished runs (`fields` added), names of
  the runs not finished, and {name: error line} of the runs that failed this time."""
  results: List[Dict[str, Any]]
  missing: List[str]
  failed: Dict[str, str]


def train_planned(planned: Iterable[tuple[str, str, Mapping[str, Any], Mapping[str, Any]]],
                  workdir_root: str, report_only: bool, jobs: int = 1,
                  log_dir: str | None = None) -> Trained:
  """Each (name, config spec, {field: Python value}, fields) is one train command (its workdir
  `<workdir_root>/<name>`; `sweeps.plan.run_for` checks its overrides parse back exactly), run
  by `sweeps.execute.run_all`, `jobs` at a time, unless `report_only`: finished runs are
  skipped, interrupted ones resume, a failed one is kept with its error line. Stopped runs
  (SIGTERM) raise RunInterrupted (exit status 0) after saying how to resume. A bad override or
  --jobs exits with one line before anything runs."""
  # pylint: disable=import-outside-toplevel  (the sweep package imports JAX: slow)
  from simplified_flax.sweeps import driver
  from simplified_flax.sweeps import execute
  from simplified_flax.sweeps import plan
  from simplified_flax.sweeps import results as sweep_results
  try:
    runs = [(plan.run_for(name, spec, overrides, workdir_root), fields)
            for name, spec, overrides, fields in planned]
    if not report_only:
      execute.device_slots(jobs)   # a bad --jobs is refused before any run starts
  except plan.SweepError as error:
    sys.exit(f"error: {error}")
  outcome = execute.Outcome()
  if runs and not report_only:
    log_dir = log_dir or driver.default_log_dir(workdir_root)
    print(f"{len(runs)} run(s) in {workdir_root} ({jobs} at a time); logs in {log_dir}",
          flush=True)
    outcome = execute.run_all([run for run, _ in runs], jobs=jobs, log_dir=log_dir)
    if outcome.interrupted:
      print(INTERRUPTED, file=sys.stderr, flush=True)
      raise RunInterrupted(0)
  trained = Trained([], [], dict(outcome.failed))
  for run, fields in runs:
    if not sweep_results.is_finished(run.workdir, run.steps):
      if run.name not in trained.failed:
        trained.missing.append(run.name)
      continue
    summary = sweep_results.summarise(run.workdir)
    config = json.loads((epath.Path(run.workdir) / "config.json").read_text())
    trained.results.append({**summary, **fields, "batch_size": config["batch_size"],
                            "eval_steps": config["eval_steps"], "model": config["model"]})
  return trained


def require_results(trained: Trained) -> None:
  """Exits with one line (and each failed run's error) when no run has finished."""
  if not trained.results:
    sys.exit("No finished runs to report." + "".join(
        f"\n{name} failed: {error}" for name, error in trained.failed.items()))


def failed_lines(failed: Mapping[str, str]) -> List[str]:
  """The report's section on failed runs (empty when none failed): each with its error line."""
  if not failed:
    return []
  return ["## Failed runs", "", "Each run's log (`<workdir_root>/logs/<name>.log`; for a "
          "gs:// root, `sweep_logs/<root name>/<name>.log`) holds the rest; a rerun of the "
          "same command tries the run again.", ""] + [
              f"- `{name}`: {error}" for name, error in failed.items()] + [""]


def exit_if_failed(failed: Mapping[str, str]) -> None:
  """After the report is written: exit status 1 naming the failed runs, if any."""
  if failed:
    sys.exit(f"{len(failed)} run(s) failed: {', '.join(failed)} (each run's error is in the "
             "report and its log).")


# ------------------------------------------------------------------------------- numbers

def mean_spread(values: Sequence[float], digits: int = 3) -> str:
  """"2.345" for one value; "2.345 ± 0.012 (n=2)": the mean ± the sample standard deviation
  (`sweeps.stats.mean_std`)."""
  from simplified_flax.sweeps import stats  # pylint: disable=import-outside-toplevel
  mean, sd = stats.mean_std(values)
  if mean is None:
    return "-"
  if sd is None:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {sd:.{digits}f} (n={len([v for v in values if v is not None])})"


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
  scripts that train, --workdir_root, --jobs and (when they can report unfinished runs)
  --report_only."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--scale", choices=sorted(scales), default="cpu")
  parser.add_argument("--output", default=None, help="report folder (default "
                      f"experiments/results/<scale>/{experiment})")
  if workdirs:
    parser.add_argument("--workdir_root", default=None,
                        help=f"training workdirs (default workdirs/{experiment}_<scale>)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, each a train command on its own GPUs or TPU "
                        "chips where the host has several (simplified_flax.sweep's --jobs)")
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


def write_report(output: str, text: str, results: Any) -> None:
  """`<output>/report.md` and `<output>/results.json`."""
  write_text(os.path.join(output, "report.md"), text)
  write_json(os.path.join(output, "results.json"), results)


def write_runs_report(output: str, text: str, *, scale: str, command: str, trained: Trained,
                      keep: Sequence[str]) -> None:
  """`write_report` of a `train_planned` experiment: results.json holds the scale, command,
  unfinished runs, failed runs (with their error lines) and the `keep` fields of every
  finished run."""
  write_report(output, text, {"scale": scale, "command": command, "missing": trained.missing,
                              "failed": trained.failed,
                              "runs": [{k: r[k] for k in keep} for r in trained.results]})
  print(f"Wrote {output}/report.md, its plots and results.json")

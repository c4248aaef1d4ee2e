"""One sweep from start to report: plan (every run checked first), print or train, extend the
grid where a best value is at its edge (extension.py), report."""
import os
import sys
from typing import Sequence

from simplified_flax.sweeps import baseline
from simplified_flax.sweeps import comparison
from simplified_flax.sweeps import execute
from simplified_flax.sweeps import extension
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import report


def default_log_dir(workdir_root: str) -> str:
  """The runs' logs: beside the workdirs when they are local, else `./sweep_logs/<root name>`
  (a gs:// root cannot take a process's output as it is written)."""
  if "://" not in workdir_root:
    return os.path.join(workdir_root, "logs")
  return os.path.join("sweep_logs", workdir_root.rstrip("/").rsplit("/", 1)[-1])


def sweep(*, config_spec: str, shared: Sequence[str], variants: Sequence[str],
          grid: Sequence[str], seeds: int, workdir_root: str, jobs: int = 1,
          print_only: bool = False, report_only: bool = False, output: str | None = None,
          reference: str | None = None, best_of: str | None = None,
          log_dir: str | None = None, command: str = "", quantize: str | None = None,
          extend: int = 2, baselines: baseline.Baselines | None = None) -> int:
  """Runs (or with `print_only` prints, or with `report_only` only reports) the sweep; the
  exit status: 0, or 1 when a run failed. A bad sweep raises plan.SweepError before anything
  starts. `quantize` ("w8a8", ...): each finished run is also evaluated so (execute.py).
  With `best_of` over a numeric field, a variant whose best value sits at an edge of the values
  tried gets the next value beyond it, up to `extend` values (extension.py); each round runs
  only its new runs. `baselines`: the unigram losses runs are held to (default: computed)."""
  if jobs < 1:
    raise plan.SweepError(f"--jobs={jobs}: give --jobs=1 or more.")
  if extend < 0:
    raise plan.SweepError(f"--extend={extend}: give 0 (no extension) or more values.")
  runs = plan.build(config_spec, shared, variants, grid, seeds, workdir_root)
  names = list(dict.fromkeys(r.variant for r in runs))
  if reference is not None and reference not in names:
    raise plan.SweepError(f"--reference={reference} is not one of the sweep's variants "
                          f"({', '.join(names)}).")
  parsed_grid = dict(plan.parse_grid(grid))
  if best_of is not None and best_of not in parsed_grid:
    raise plan.SweepError(f"--best_of={best_of} is not a --grid field"
                          + (f" ({', '.join(parsed_grid)})" if parsed_grid else " (no --grid)")
                          + f"; add --grid={best_of}=v1,v2,...")
  if not (print_only or report_only):
    execute.device_slots(jobs)   # a bad --jobs is refused before any run starts
  baselines = baselines or baseline.Baselines()
  grid_values = sorted({dict(r.point)[best_of] for r in runs}) if best_of else []
  extending = bool(best_of) and extend > 0 and comparison.numeric(grid_values)
  output = output or plan.join(workdir_root, "report")
  log_dir = log_dir or default_log_dir(workdir_root)
  outcome, planned, new = execute.Outcome(), [], runs
  while new:
    planned += new
    if print_only:
      if not _print(new):
        return 0
    elif not report_only:
      print(f"Sweep of {len(new)} runs in {workdir_root} ({jobs} at a time); logs in "
            f"{log_dir}" + ("" if new is runs else f" (grid extended: {_extended(new, best_of)})"),
            flush=True)
      done = execute.run_all(new, jobs=jobs, log_dir=log_dir, quantize=quantize)
      outcome.failed.update(done.failed)
      if done.interrupted:
        print("Sweep stopped: every finished run and every stopped run's checkpoint stays; "
              "rerun the same command to go on.", file=sys.stderr, flush=True)
        return 0
    if not extending:
      break
    groups = comparison.groups(comparison.collect(planned, outcome.failed,
                                                  baselines=baselines))
    known = {r.name for r in planned}
    new = [run for variant, rest, value in extension.needed(groups, best_of, grid_values, extend)
           for run in plan.point_runs(config_spec, shared, variant, grid,
                                      {**dict(rest), best_of: value}, seeds, workdir_root)
           if run.name not in known]
  if print_only:
    if extending:
      print(f"# --best_of={best_of} extends the grid where a variant's best value is at an "
            f"edge (up to --extend={extend} values): which runs that adds needs the results of "
            "the runs above; rerun --print once they have finished.", file=sys.stderr,
            flush=True)
    return 0
  collected = report.write(planned, output, command=command, reference=reference,
                           best_of=best_of, failed=outcome.failed, quantize=quantize,
                           baselines=baselines, extend=extend if extending else 0)
  done = sum(c.summary is not None for c in collected)
  print(f"Wrote {plan.join(output, 'report.md')} ({done} of {len(planned)} runs finished), its "
        "plots and results.json", flush=True)
  if outcome.failed:
    print(f"{len(outcome.failed)} run(s) failed: {', '.join(outcome.failed)} (each run's error "
          "is in the report and its log).", file=sys.stderr, flush=True)
    return 1
  return 0


def _print(runs) -> bool:
  """Prints each run's train command; False once the reader has closed the pipe."""
  try:
    for run in runs:
      print(run.command(), flush=True)
  except BrokenPipeError:   # `--print | head`: the reader took what it wanted
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return False
  return True


def _extended(runs, field: str) -> str:
  """`sas_p at 0.008, preln at 0.0005`: the variants and values a round of extension adds."""
  added = dict.fromkeys(f"{r.variant} at {plan.format_value(dict(r.point)[field])}" for r in runs)
  return ", ".join(added)

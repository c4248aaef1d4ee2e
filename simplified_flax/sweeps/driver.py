"""One sweep from start to report: plan (every run checked first), print or train, report."""
import os
import sys
from typing import Sequence

from simplified_flax.sweeps import execute
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
          log_dir: str | None = None, command: str = "", quantize: str | None = None) -> int:
  """Runs (or with `print_only` prints, or with `report_only` only reports) the sweep; the
  exit status: 0, or 1 when a run failed. A bad sweep raises plan.SweepError before anything
  starts. `quantize` ("w8a8", ...): each finished run is also evaluated so (execute.py)."""
  if jobs < 1:
    raise plan.SweepError(f"--jobs={jobs}: give --jobs=1 or more.")
  runs = plan.build(config_spec, shared, variants, grid, seeds, workdir_root)
  names = list(dict.fromkeys(r.variant for r in runs))
  if reference is not None and reference not in names:
    raise plan.SweepError(f"--reference={reference} is not one of the sweep's variants "
                          f"({', '.join(names)}).")
  grid_fields = [field for field, _ in plan.parse_grid(grid)]
  if best_of is not None and best_of not in grid_fields:
    raise plan.SweepError(f"--best_of={best_of} is not a --grid field"
                          + (f" ({', '.join(grid_fields)})" if grid_fields else " (no --grid)")
                          + f"; add --grid={best_of}=v1,v2,...")
  if print_only:
    try:
      for run in runs:
        print(run.command(), flush=True)
    except BrokenPipeError:   # `--print | head`: the reader took what it wanted
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  output = output or plan.join(workdir_root, "report")
  outcome = execute.Outcome()
  if not report_only:
    execute.device_slots(jobs)   # a bad --jobs is refused before any run starts
    print(f"Sweep of {len(runs)} runs in {workdir_root} ({jobs} at a time); logs in "
          f"{log_dir or default_log_dir(workdir_root)}", flush=True)
    outcome = execute.run_all(runs, jobs=jobs, log_dir=log_dir or default_log_dir(workdir_root),
                              quantize=quantize)
    if outcome.interrupted:
      print("Sweep stopped: every finished run and every stopped run's checkpoint stays; rerun "
            "the same command to go on.", file=sys.stderr, flush=True)
      return 0
  collected = report.write(runs, output, command=command, reference=reference,
                           best_of=best_of, failed=outcome.failed, quantize=quantize)
  done = sum(c.summary is not None for c in collected)
  print(f"Wrote {plan.join(output, 'report.md')} ({done} of {len(runs)} runs finished), its "
        "plots and results.json", flush=True)
  if outcome.failed:
    print(f"{len(outcome.failed)} run(s) failed: {', '.join(outcome.failed)} (each run's error "
          "is in the report and its log).", file=sys.stderr, flush=True)
    return 1
  return 0

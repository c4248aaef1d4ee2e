"""Runs a sweep: each unfinished run as its own `python -m simplified_flax.train` process,
`jobs` at a time, each job on its own devices where the host has several. With `quantize`
(e.g. "w8a8"), each finished run's final checkpoint is then evaluated once more by
`python -m simplified_flax.evaluate --quantize=...` (results.quantized_eval_file).

A finished run (its history reaches the last step's evaluation) is skipped; an interrupted one
resumes from its checkpoint, as the train command always does. A run that fails (a NaN loss, a
bad data file) is reported with its one error line and the others go on. SIGTERM (or Ctrl-C)
stops the running ones the way the train command stops (a checkpoint, exit 0) and starts no
more: rerun the same sweep command to go on.
"""
import collections
import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Sequence

from simplified_flax.runs import metrics_io
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import results

# libtpu's per-process chip bounds for 1, 2 and 4 chips of one host (a process's chips must be
# a box of the host's chip grid).
_TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}
_TPU_FIRST_PORT = 8476


@dataclasses.dataclass
class Outcome:
  """What `run_all` did: names finished (before or now), trained now, failed (with the run's
  error line), and whether it was stopped before the end."""
  finished: list[str] = dataclasses.field(default_factory=list)
  trained: list[str] = dataclasses.field(default_factory=list)
  failed: dict[str, str] = dataclasses.field(default_factory=dict)
  interrupted: bool = False


def _visible_gpus(environ: Mapping[str, str]) -> list[str]:
  if environ.get("CUDA_VISIBLE_DEVICES") is not None:
    return [d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
  if shutil.which("nvidia-smi") is None:
    return []
  listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
  return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU")]


def _tpu_chips() -> int:
  return len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*"))


def device_slots(jobs: int, environ: Mapping[str, str] | None = None,
                 gpus: Sequence[str] | None = None, tpu_chips: int | None = None
                 ) -> list[dict[str, str]]:
  """The environment of each of `jobs` parallel runs: on a host with N GPUs, N/jobs of them
  each (CUDA_VISIBLE_DEVICES); with N TPU chips, N/jobs chips each (libtpu's
  TPU_VISIBLE_CHIPS and per-process bounds, one port each); on CPUs, the same host for all.
  A split that does not divide the devices evenly is one SweepError line."""
  environ = os.environ if environ is None else environ
  if jobs < 1:
    raise plan.SweepError(f"--jobs={jobs}: give --jobs=1 or more.")
  if jobs == 1:
    return [{}]
  gpus = _visible_gpus(environ) if gpus is None else list(gpus)
  chips = _tpu_chips() if tpu_chips is None else tpu_chips
  if gpus:
    if len(gpus) % jobs:
      raise plan.SweepError(f"--jobs={jobs} does not divide this host's {len(gpus)} GPUs; give "
                            f"a divisor of {len(gpus)}.")
    per = len(gpus) // jobs
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}
            for i in range(jobs)]
  if chips:
    per = chips // jobs
    if chips % jobs or per not in _TPU_BOUNDS:
      raise plan.SweepError(f"--jobs={jobs} on this host's {chips} TPU chips: give a number "
                            f"that leaves 1, 2 or 4 chips per run "
                            f"({', '.join(str(chips // p) for p in _TPU_BOUNDS if chips % p == 0 and p <= chips)}).")
    slots = []
    for i in range(jobs):
      chip_ids = ",".join(str(c) for c in range(i * per, (i + 1) * per))
      port = str(_TPU_FIRST_PORT + i)
      slots.append({"TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_BOUNDS[per],
                    "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_VISIBLE_CHIPS": chip_ids,
                    "TPU_VISIBLE_DEVICES": chip_ids, "TPU_PROCESS_PORT": port,
                    "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
                    "TPU_MESH_CONTROLLER_PORT": port})
    return slots
  return [{} for _ in range(jobs)]


def error_line(log_path: str) -> str:
  """The run's one-line error (`simplified_flax.train: error: ...`), else its log's last line."""
  try:
    with open(log_path, encoding="utf-8", errors="replace") as log:
      lines = [line.strip() for line in log if line.strip()]
  except OSError:
    return "no log"
  errors = [line for line in lines if ": error: " in line]
  return (errors or lines or ["exited without output"])[-1]


def _evaluate(run: plan.Run, scheme: str, python: str, env: Mapping[str, str], log) -> bool:
  """`python -m simplified_flax.evaluate --quantize=scheme` on the run's final checkpoint; its
  JSON line saved beside the run (results.quantized_eval_file). Whether it succeeded."""
  done = subprocess.run([python, "-m", "simplified_flax.evaluate", f"--workdir={run.workdir}",
                         f"--quantize={scheme}"], env=env, stdout=subprocess.PIPE,
                        stderr=log, check=False)
  lines = done.stdout.decode(errors="replace").strip().splitlines()
  if done.returncode != 0 or not lines:
    log.write(done.stdout)
    return False
  results.write_quantized_eval(run.workdir, scheme, lines[-1])
  return True


def _queue(runs: Sequence[plan.Run], quantize: str | None, outcome: Outcome) -> collections.deque:
  """The runs to train (unfinished) or, with `quantize`, to evaluate only (finished, without
  their quantized evaluation), in sweep order; finished runs are recorded in `outcome`."""
  todo = collections.deque()
  for run in runs:
    if results.is_finished(run.workdir, run.steps):
      outcome.finished.append(run.name)
      if quantize and results.quantized_eval(run.workdir, quantize) is None:
        todo.append(run)
    else:
      todo.append(run)
  return todo


@dataclasses.dataclass(eq=False)   # compared by identity, like any worker pool
class _Workers:
  """`len(slots)` threads taking runs from `todo`, each run a child process; one lock guards
  the outcome, the queue and the running processes."""
  todo: collections.deque            # runs left (`_queue`), in sweep order
  outcome: Outcome                   # so far: the runs finished before are in it already
  total: int                         # runs in the sweep, for the progress line
  slots: list[dict[str, str]]        # per thread, the environment that gives its devices
  log_dir: str                       # each run's output goes to <log_dir>/<name>.log
  python: str                        # the interpreter that runs train and evaluate
  say: Callable[[str], None]         # progress lines
  quantize: str | None               # the scheme of the extra evaluation, if any
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
  running: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)
  started: float = dataclasses.field(default_factory=time.monotonic)

  def progress(self, run: plan.Run, seconds: float, what: str) -> None:
    """One line: runs done / total, what happened to `run`, the ETA. Under the lock."""
    outcome = self.outcome
    done = len(outcome.finished) + len(outcome.failed)
    left = self.total - done
    eta = ""
    if left and outcome.trained:
      per_run = (time.monotonic() - self.started) / (len(outcome.trained) + len(outcome.failed))
      eta = f"; ETA {metrics_io.format_duration(per_run * left / len(self.slots))}"
    self.say(f"[{done}/{self.total}] {run.name}: {what} ({metrics_io.format_duration(seconds)})"
             f"{eta}")

  def evaluate_only(self, run: plan.Run, env: Mapping[str, str], log, log_path: str) -> None:
    ok = _evaluate(run, self.quantize, self.python, env, log)
    with self.lock:
      if not ok:
        self.outcome.failed[run.name] = f"{self.quantize} evaluation: {error_line(log_path)}"
      self.say(f"{run.name}: {self.quantize} evaluation "
               + ("written" if ok else f"FAILED (log: {log_path})"))

  def train(self, run: plan.Run, env: Mapping[str, str], log, log_path: str) -> None:
    """Trains `run` (then evaluates it, with `quantize`) and records how it ended."""
    began = time.monotonic()
    process = subprocess.Popen([self.python, "-m", plan.TRAIN_MODULE, *run.train_args()],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    with self.lock:
      self.running[run.name] = process
    status = process.wait()
    with self.lock:
      self.running.pop(run.name)
    trained = status == 0 and results.is_finished(run.workdir, run.steps)
    evaluated = (not trained or not self.quantize or self.stopping.is_set()
                 or _evaluate(run, self.quantize, self.python, env, log))
    seconds = time.monotonic() - began
    with self.lock:
      outcome = self.outcome
      if trained:
        outcome.finished.append(run.name)
        outcome.trained.append(run.name)
        loss = results.final_eval_loss(run.workdir)
        if not evaluated:
          outcome.failed[run.name] = f"{self.quantize} evaluation: {error_line(log_path)}"
        self.progress(run, seconds, f"final eval loss {loss:.4f}" + (
            "" if evaluated else f"; {self.quantize} evaluation FAILED (log: {log_path})"))
      elif status == 0 or self.stopping.is_set():
        outcome.interrupted = True   # stopped with its checkpoint: resumes on a rerun
        self.stopping.set()
      else:
        outcome.failed[run.name] = error_line(log_path)
        self.progress(run, seconds, f"FAILED: {outcome.failed[run.name]} (log: {log_path})")

  def work(self, slot_env: dict[str, str]) -> None:
    """One thread: the next queued run on this slot's devices, until none is left or a stop."""
    while not self.stopping.is_set():
      with self.lock:
        if not self.todo:
          return
        run = self.todo.popleft()
        evaluate_only = run.name in self.outcome.finished
      log_path = os.path.join(self.log_dir, f"{run.name}.log")
      env = {**os.environ, **slot_env}
      with open(log_path, "ab") as log:
        (self.evaluate_only if evaluate_only else self.train)(run, env, log, log_path)

  def stop(self, signum=None, frame=None) -> None:
    """Starts no more runs; SIGTERM to the running ones (each saves a checkpoint, exits 0)."""
    del signum, frame
    self.stopping.set()
    with self.lock:
      for process in self.running.values():
        process.send_signal(signal.SIGTERM)

  def run(self) -> None:
    """Every thread to its end; SIGTERM (main thread only) and Ctrl-C stop them."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, self.stop) if in_main else None
    threads = [threading.Thread(target=self.work, args=(slot,), daemon=True)
               for slot in self.slots]
    try:
      for thread in threads:
        thread.start()
      while any(thread.is_alive() for thread in threads):
        for thread in threads:
          thread.join(timeout=0.2)
    except KeyboardInterrupt:
      self.stop()
      for thread in threads:
        thread.join()
      self.outcome.interrupted = True
    finally:
      if in_main:
        signal.signal(signal.SIGTERM, previous)
    self.outcome.interrupted = self.outcome.interrupted or self.stopping.is_set()


def run_all(runs: Sequence[plan.Run], *, jobs: int = 1, log_dir: str,
            python: str = sys.executable, say: Callable[[str], None] = print,
            quantize: str | None = None) -> Outcome:
  """Trains every unfinished run of `runs` (logs in `log_dir/<name>.log`) and, with `quantize`,
  evaluates every finished one that lacks its quantized evaluation; see the module doc.
  One progress line per run that ends: runs done / total, its final eval loss, the ETA."""
  outcome = Outcome()
  todo = _queue(runs, quantize, outcome)
  slots = device_slots(min(jobs, max(len(todo), 1)))
  to_train = [run for run in todo if run.name not in outcome.finished]
  if outcome.finished:
    say(f"{len(outcome.finished)} of {len(runs)} runs finished already (skipped); "
        f"{len(to_train)} to train, {len(slots)} at a time"
        + (f"; {len(todo) - len(to_train)} to evaluate ({quantize})."
           if len(todo) > len(to_train) else "."))
  if todo:
    os.makedirs(log_dir, exist_ok=True)
    _Workers(todo=todo, outcome=outcome, total=len(runs), slots=slots, log_dir=log_dir,
             python=python, say=say, quantize=quantize).run()
  return outcome

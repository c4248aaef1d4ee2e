"""A run's history, written by process 0 through `etils.epath` (the workdir may be gs://):
`metrics.jsonl` (one JSON object per logged step), cut back on resume (`cut_history`), and
TensorBoard events (`tensorboardX`, no TensorFlow), never rewritten: each run's file starts
with a purge step hiding what earlier files logged after it. Also the console's progress line.
"""
import contextlib
import io
import json
import math
import time
from typing import Any, Mapping

from etils import epath
import jax
from tensorboardX import record_writer
from tensorboardX import summary
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog

from simplified_flax.runs.compatibility import flatten_config
from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.storage import is_remote, write_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Object stores cannot append: a remote metrics.jsonl is rewritten whole this often at most
# (and at each flush, which the loop calls before every checkpoint).
REMOTE_REWRITE_EVERY_S = 30.0
# TensorBoard groups charts by the tag's first segment: the loop's scalars go under train/ and
# eval/ (metrics.jsonl keeps the flat names); other tags (`kurtosis/layer_0`) are grouped.
TRAIN_SCALARS = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "elapsed_s")
CONFIG_TAG = "config"   # the run's config, a text summary at the first step it trains


def _jsonl(rows) -> str:
  return "".join(json.dumps(r) + "\n" for r in rows)


class _ObjectStoreFile:
  """A file in an object store (through epath), which cannot append: kept in memory and
  rewritten whole at each flush."""

  def __init__(self, path: str):
    self._path, self._buffer = epath.Path(path), io.BytesIO()
    self.write = self._buffer.write
    if storage.exists(self._path):
      self.write(storage.read_bytes(self._path))

  @classmethod
  def open(cls, path: str) -> "_ObjectStoreFile":   # tensorboardX's writer-factory interface
    return cls(path)

  def flush(self) -> None:
    write_atomically(self._path, lambda f: f.write(self._buffer.getvalue()))

  def close(self) -> None:
    self.flush()


def tensorboard_tag(name: str) -> str:
  """'loss' -> 'train/loss', 'eval_loss' -> 'eval/loss'; any other name as it is."""
  if name in TRAIN_SCALARS:
    return f"train/{name}"
  if name.startswith("eval_"):
    return f"eval/{name[len('eval_'):]}"
  return name


class MetricsWriter:
  """A run's history on process 0 (elsewhere it writes nothing): metrics.jsonl rows appended and
  flushed row by row (remote: rewritten whole, REMOTE_REWRITE_EVERY_S); with `tensorboard`, an
  event file through tensorboardX's synchronous EventsWriter (SummaryWriter's flush leaves its
  thread's queue unwritten) opening with a purge at `start_step + 1` (a SessionLog START, as
  `purge_step`) and `config_dict` as the text summary `config` at that step."""

  def __init__(self, workdir: str, tensorboard: bool = True, start_step: int = 0,
               config_dict: dict | None = None):
    self._rows = self._events = None
    if jax.process_index() != 0:
      return
    logdir = epath.Path(workdir) / TENSORBOARD_DIR
    logdir.parent.mkdir(parents=True, exist_ok=True)
    self._remote = is_remote(workdir)
    path = logdir.parent / METRICS_FILE
    self._rows = _ObjectStoreFile(path) if self._remote else path.open("ab")
    self._flushed = time.time()
    if not tensorboard:
      return
    logdir.mkdir(exist_ok=True)
    if self._remote:   # through epath, as every other file of the workdir
      record_writer.register_writer_factory(str(logdir).split(":")[0], _ObjectStoreFile)
    # The suffix keeps two files of one second apart, ordered as TensorBoard reads them.
    self._events = EventsWriter(f"{logdir}/events", f".{time.time_ns()}")
    self._event(start_step + 1, session_log=SessionLog(status=SessionLog.START))
    if config_dict is not None:
      lines = [f"    {k} = {v!r}" for k, v in sorted(flatten_config(config_dict).items())]
      self._event(start_step + 1, summary=summary.text(CONFIG_TAG, "\n".join(lines)))

  def _event(self, step: int, **what) -> None:
    self._events.write_event(Event(wall_time=time.time(), step=int(step), **what))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if self._rows is None:
      return
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    self._rows.write(_jsonl([row]).encode())
    if not self._remote or time.time() - self._flushed >= REMOTE_REWRITE_EVERY_S:
      self._rows.flush()
      self._flushed = time.time()
    if self._events is not None:
      for name, value in scalars.items():
        self._event(step, summary=summary.scalar(tensorboard_tag(name), float(value)))

  def flush(self) -> None:
    for file in filter(None, (self._rows, self._events)):
      file.flush()

  def close(self) -> None:
    for file in filter(None, (self._rows, self._events)):
      file.close()


def read_history(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file. A torn last line (a killed run) and blank lines are
  skipped; any other line that is not a JSON object, or a file that is not UTF-8, raises a
  one-line checkpoints.WorkdirError naming the line (before anything is rewritten)."""
  # pylint: disable-next=import-outside-toplevel
  from simplified_flax.runs.checkpoints import WorkdirError   # imports Orbax: only when read
  path = epath.Path(path)
  try:
    lines = storage.read_text(path).splitlines() if storage.exists(path) else []
  except UnicodeDecodeError:
    raise WorkdirError(f"{path} is damaged (not UTF-8 text). {_HISTORY_FIX}") from None
  rows = []
  for number, line in enumerate(lines, start=1):
    row = _parse_row(line)
    if isinstance(row, dict):
      rows.append(row)
    elif line.strip() and number < len(lines):
      raise WorkdirError(f"{path} is damaged (line {number} of {len(lines)} is not a JSON "
                         f"object). {_HISTORY_FIX}")
  return rows


_HISTORY_FIX = ("Fix or delete the damaged part (the file is the run's log only; checkpoints "
                "do not depend on it) and rerun.")


def _parse_row(line: str):
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    return None


def cut_history(workdir: str, step: int, aside: epath.Path | None = None) -> None:
  """Rewrites metrics.jsonl without the rows after `step` (or a torn line), in one pass. With
  `aside` (a rewind's folder), those rows move to `aside/metrics.jsonl` and the TensorBoard
  event files are copied to `aside/tensorboard/`, so the run rewound past stays viewable."""
  workdir = epath.Path(workdir)
  path = workdir / METRICS_FILE
  rows = read_history(path)
  later = [r for r in rows if r.get("step", 0) > step]
  if aside is not None and later:
    (aside / TENSORBOARD_DIR).mkdir(parents=True, exist_ok=True)
    moved = _jsonl(later).encode()
    write_atomically(aside / METRICS_FILE, lambda f: f.write(moved))
    tensorboard = workdir / TENSORBOARD_DIR
    for events in retries.call("list", tensorboard,
                               lambda: list(tensorboard.glob("events.out.tfevents.*"))):
      target = aside / TENSORBOARD_DIR / events.name
      retries.call("copy", events, lambda e=events, t=target: e.copy(t, overwrite=True))
  if storage.exists(path):
    text = _jsonl(r for r in rows if r.get("step", 0) <= step).encode()
    write_atomically(path, lambda f: f.write(text))


class Progress:
  """Throughput, elapsed time and ETA between successive `update` calls."""

  def __init__(self, *, total_steps: int, start_step: int, tokens_per_step: int,
               elapsed_before: float = 0.0):
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self._elapsed_before = elapsed_before
    self._start = self._last_time = time.time()
    self._last_step = start_step

  @contextlib.contextmanager
  def paused(self):
    """Time spent inside (evals, checkpoint saves) does not count against throughput."""
    start = time.time()
    try:
      yield
    finally:
      self._last_time += time.time() - start

  def restart_clock(self) -> None:
    """Starts the interval now: called once the first (compiling) step has been dispatched, so
    tokens/s and the ETA leave out compilation; the elapsed time is wall-clock time."""
    self._last_time = time.time()

  def update(self, step: int) -> dict[str, float]:
    """{"tokens_per_s", "elapsed_s", "eta_s"} since the previous update (or restart)."""
    now = time.time()
    steps_per_s = (step - self._last_step) / max(now - self._last_time, 1e-9)
    self._last_time, self._last_step = now, step
    eta = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else math.inf
    return {"tokens_per_s": steps_per_s * self.tokens_per_step,
            "elapsed_s": self._elapsed_before + now - self._start, "eta_s": eta}

  def elapsed(self) -> float:
    return self._elapsed_before + time.time() - self._start

  def line(self, step: int, loss: float, learning_rate: float, rates: dict) -> str:
    return (f"step {step}/{self.total_steps} | loss {loss:.4f} | lr {learning_rate:.3e} | "
            f"{rates['tokens_per_s']:,.0f} tok/s | ETA {format_duration(rates['eta_s'])}")


def format_duration(seconds: float) -> str:
  """4000 -> '1h06m40s'."""
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"

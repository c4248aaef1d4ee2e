"""A run's history: `metrics.jsonl` and TensorBoard events (process 0 writes both), its cut back
to a resumed step, and the progress line.

`<workdir>/metrics.jsonl` holds one JSON object per logged step, readable by any script:

    {"step": 50, "loss": 3.21, "learning_rate": 0.001, "grad_norm": 0.8,
     "tokens_per_s": 51200.0, "elapsed_s": 12.5}
    {"step": 250, "eval_loss": 2.9, "eval_perplexity": 18.2}
    {"step": 500, "kurtosis/layer_0": 0.4, "attn_entropy/layer_0": 2.1, "gain/h_0/...": 0.9}

(the last kind every `config.diagnostics_every` steps, per layer). A resume rewrites it
without the rows after the restored step (`cut_history`), so it reads as one uninterrupted
run. TensorBoard events are written by `tensorboardX` (no TensorFlow) and never rewritten:
each run's event file starts with a purge step that makes TensorBoard hide what earlier files
logged after the restored step. Every file goes through `etils.epath`, so the workdir may be
`gs://...` (README "Remote workdirs").
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

from simplified_flax.runs.checkpoints import flatten_config
from simplified_flax.storage import is_remote, write_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Object stores (gs://, s3://) cannot append: a remote metrics.jsonl is rewritten whole, at
# most this often (and at every flush/close, which the loop calls before each checkpoint).
REMOTE_REWRITE_EVERY_S = 30.0
# TensorBoard groups charts by the tag's first segment: the loop's scalars go under train/ and
# eval/ (metrics.jsonl keeps the flat names); other tags (`kurtosis/layer_0`) are grouped.
TRAIN_SCALARS = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "elapsed_s")
CONFIG_TAG = "config"   # the run's config, a text summary at the first step it trains


def _jsonl(rows) -> str:
  return "".join(json.dumps(r) + "\n" for r in rows)


class JsonlWriter:
  """Writes `{"step": step, **scalars}` rows to a JSON-lines file (local: appended and flushed
  row by row; remote: the whole file rewritten, see REMOTE_REWRITE_EVERY_S)."""

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._path.parent.mkdir(parents=True, exist_ok=True)
    self._remote = is_remote(path)
    self._rows = read_history(path) if self._remote else None
    self._file = None if self._remote else self._path.open("a")
    self._last_rewrite = time.time()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    if not self._remote:
      self._file.write(_jsonl([row]))
      self._file.flush()
      return
    self._rows.append(row)
    if time.time() - self._last_rewrite >= REMOTE_REWRITE_EVERY_S:
      self.flush()

  def flush(self) -> None:
    if self._remote:
      text = _jsonl(self._rows).encode()
      write_atomically(self._path, lambda f: f.write(text))
      self._last_rewrite = time.time()
    else:
      self._file.flush()

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


def tensorboard_tag(name: str) -> str:
  """'loss' -> 'train/loss', 'eval_loss' -> 'eval/loss'; any other name as it is."""
  if name in TRAIN_SCALARS:
    return f"train/{name}"
  if name.startswith("eval_"):
    return f"eval/{name[len('eval_'):]}"
  return name


class _ObjectStoreFile:
  """An event file in an object store (through epath), rewritten whole at each flush."""

  def __init__(self, path: str):
    self._path, self._buffer = epath.Path(path), io.BytesIO()

  @classmethod
  def open(cls, path: str) -> "_ObjectStoreFile":   # tensorboardX's writer-factory interface
    return cls(path)

  def write(self, data: bytes) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    write_atomically(self._path, lambda f: f.write(self._buffer.getvalue()))

  def close(self) -> None:
    self.flush()


class TensorBoardWriter:
  """TensorBoard event files in `logdir`, written by tensorboardX's synchronous EventsWriter
  (its SummaryWriter queues events to a thread, and a flush there leaves the queue unwritten).

  The file opens with a purge at `start_step + 1` (a SessionLog START, as SummaryWriter's
  `purge_step` writes it): TensorBoard hides the events that earlier files logged from that
  step on, the tail of a killed or rewound run. `config_dict`, when given, is written as the
  text summary `config` at that step. Tags are grouped (`tensorboard_tag`).
  """

  def __init__(self, logdir: str, start_step: int = 0, config_dict: dict | None = None):
    epath.Path(logdir).mkdir(parents=True, exist_ok=True)
    if is_remote(logdir):   # through epath, as every other file of the workdir
      record_writer.register_writer_factory(logdir.split(":")[0], _ObjectStoreFile)
    # The suffix keeps two files of one second apart, ordered as TensorBoard reads them.
    self._events = EventsWriter(f"{logdir}/events", f".{time.time_ns()}")
    self._write(start_step + 1, session_log=SessionLog(status=SessionLog.START))
    if config_dict is not None:
      lines = [f"    {k} = {v!r}" for k, v in sorted(flatten_config(config_dict).items())]
      self._write(start_step + 1, summary=summary.text(CONFIG_TAG, "\n".join(lines)))

  def _write(self, step: int, **what) -> None:
    self._events.write_event(Event(wall_time=time.time(), step=int(step), **what))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for name, value in scalars.items():
      self._write(step, summary=summary.scalar(tensorboard_tag(name), float(value)))

  def flush(self) -> None:
    self._events.flush()

  def close(self) -> None:
    self._events.close()


class MultiWriter:
  """Forwards every call to each of `writers` (none: a no-op writer, as on processes > 0)."""

  def __init__(self, writers):
    self._writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self._writers:
      w.write_scalars(step, scalars)

  def flush(self) -> None:
    for w in self._writers:
      w.flush()

  def close(self) -> None:
    for w in self._writers:
      w.close()


def make_writer(workdir: str, tensorboard: bool = True, start_step: int = 0,
                config_dict: dict | None = None) -> MultiWriter:
  """metrics.jsonl (+ TensorBoard event files under <workdir>/tensorboard, see
  TensorBoardWriter) of a run that trains from `start_step + 1`, on process 0."""
  if jax.process_index() != 0:
    return MultiWriter([])
  writers = [JsonlWriter(str(epath.Path(workdir) / METRICS_FILE))]
  if tensorboard:
    writers.append(TensorBoardWriter(str(epath.Path(workdir) / TENSORBOARD_DIR), start_step,
                                     config_dict))
  return MultiWriter(writers)


def read_history(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
  rows = []
  path = epath.Path(path)
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


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
    (aside / METRICS_FILE).write_text(_jsonl(later))
    for events in (workdir / TENSORBOARD_DIR).glob("events.out.tfevents.*"):
      events.copy(aside / TENSORBOARD_DIR / events.name)
  if path.exists():
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
    """Starts the current interval now: the loop calls it once the first step has been
    dispatched (jit compiles inside that call), so tokens/s and the ETA never include
    compilation. The elapsed time still does: it is wall-clock time."""
    self._last_time = time.time()

  def update(self, step: int) -> dict[str, float]:
    """{"tokens_per_s", "elapsed_s", "eta_s"} since the previous update (or the start, or
    `restart_clock`)."""
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
  seconds = int(seconds)
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"

"""A run's history: metric writers (`metrics.jsonl` + TensorBoard) and the progress line.

`<workdir>/metrics.jsonl` holds one JSON object per logged step, readable by any script:

    {"step": 50, "loss": 3.21, "learning_rate": 0.001, "grad_norm": 0.8,
     "tokens_per_s": 51200.0, "elapsed_s": 12.5}
    {"step": 250, "eval_loss": 2.9, "eval_perplexity": 18.2}
    {"step": 500, "kurtosis/layer_0": 0.4, "attn_entropy/layer_0": 2.1, "gain/h_0/...": 0.9}

(the last kind every `config.diagnostics_every` steps: the signal-propagation diagnostics, per
layer.)

On resume, rows after the restored step (written by the run that died) are dropped, so the
file reads as one uninterrupted run. Only process 0 writes. Every file goes through
`etils.epath`, so the workdir may be `gs://...` (README "Remote workdirs"); neither writer
needs TensorFlow.
"""
import contextlib
import io
import json
import math
import struct
import time
from typing import Any, Mapping

from absl import logging
from etils import epath
import jax

from simplified_flax.storage import is_remote, write_atomically

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Object stores (gs://, s3://) cannot append: a remote metrics.jsonl is rewritten whole, at
# most this often (and at every flush/close, which the loop calls before each checkpoint).
REMOTE_REWRITE_EVERY_S = 30.0


class JsonlWriter:
  """Writes `{"step": step, **scalars}` rows to a JSON-lines file (local: appended and flushed
  row by row; remote: the whole file rewritten, see REMOTE_REWRITE_EVERY_S)."""

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._path.parent.mkdir(parents=True, exist_ok=True)
    self._remote = is_remote(path)
    self._rows = [json.dumps(r) for r in read_history(path)] if self._remote else None
    self._file = None if self._remote else self._path.open("a")
    self._last_rewrite = time.time()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    row = json.dumps({"step": int(step), **{k: float(v) for k, v in scalars.items()}})
    if self._remote:
      self._rows.append(row)
      if time.time() - self._last_rewrite >= REMOTE_REWRITE_EVERY_S:
        self.flush()
    else:
      self._file.write(row + "\n")
      self._file.flush()

  def flush(self) -> None:
    if self._remote:
      text = "".join(r + "\n" for r in self._rows).encode()
      write_atomically(self._path, lambda f: f.write(text))
      self._last_rewrite = time.time()
    else:
      self._file.flush()

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


# TensorBoard groups charts by the tag's first segment: the loop's scalars go under train/ and
# eval/ (metrics.jsonl keeps the flat names); other tags (`kurtosis/layer_0`) are grouped.
TRAIN_SCALARS = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "elapsed_s")
CONFIG_TAG = "config"   # the run's config, a text summary at the step it starts from


def tensorboard_tag(name: str) -> str:
  """'loss' -> 'train/loss', 'eval_loss' -> 'eval/loss'; any other name as it is."""
  if name in TRAIN_SCALARS:
    return f"train/{name}"
  if name.startswith("eval_"):
    return f"eval/{name[len('eval_'):]}"
  return name


class TensorBoardWriter:
  """Scalar event files TensorBoard reads, written with `tensorboard`'s protos and record
  framing (no TensorFlow) to any epath location. A remote event file appears when closed.
  Tags are grouped (`tensorboard_tag`); `write_config` adds the run's config as text."""

  def __init__(self, logdir: str):
    # pylint: disable=import-outside-toplevel
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    directory = epath.Path(logdir)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"events.out.tfevents.{time.time():.6f}.{jax.process_index()}.simplified_flax"
    self._file = (directory / name).open("wb")
    self._records = RecordWriter(self._file)
    self._write(self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    values = [self._summary_pb2.Summary.Value(tag=tensorboard_tag(k), simple_value=float(v))
              for k, v in scalars.items()]
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=self._summary_pb2.Summary(value=values)))

  def write_config(self, step: int, config_dict: Mapping[str, Any]) -> None:
    """The config as TensorBoard text (a markdown code block of `field = value` lines)."""
    # pylint: disable=import-outside-toplevel
    from tensorboard.compat.proto import tensor_pb2, types_pb2
    lines = [f"{k} = {v!r}" for k, v in sorted(_flat(config_dict).items())]
    text = "\n".join("    " + line for line in lines).encode()
    metadata = self._summary_pb2.SummaryMetadata(
        plugin_data=self._summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    value = self._summary_pb2.Summary.Value(
        tag=CONFIG_TAG, metadata=metadata,
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text]))
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=self._summary_pb2.Summary(value=[value])))

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class MultiWriter:
  """Forwards every call to each of `writers` (none: a no-op writer, as on processes > 0)."""

  def __init__(self, writers):
    self._writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self._writers:
      w.write_scalars(step, scalars)

  def write_config(self, step: int, config_dict: Mapping[str, Any]) -> None:
    for w in (w for w in self._writers if hasattr(w, "write_config")):
      w.write_config(step, config_dict)

  def flush(self) -> None:
    for w in self._writers:
      w.flush()

  def close(self) -> None:
    for w in self._writers:
      w.close()


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"model": {"n_layer": 2}} -> {"model.n_layer": 2}."""
  return {key: leaf for k, v in d.items() for key, leaf in (
      _flat(v, f"{prefix}{k}.").items() if isinstance(v, Mapping) else [(f"{prefix}{k}", v)])}


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


def truncate_history(workdir: str, last_step: int) -> None:
  """Drops what a killed or rewound run logged after `last_step` (rows of metrics.jsonl, the
  TensorBoard summaries; each file replaced whole, torn tails dropped). No TensorFlow."""
  path = epath.Path(workdir) / METRICS_FILE
  if path.exists():
    text = "".join(json.dumps(r) + "\n" for r in read_history(path)
                   if r.get("step", 0) <= last_step).encode()
    write_atomically(path, lambda f: f.write(text))
  tensorboard = epath.Path(workdir) / TENSORBOARD_DIR
  if not tensorboard.exists():
    return
  # pylint: disable=import-outside-toplevel
  from tensorboard.compat.proto import event_pb2
  from tensorboard.summary.writer.record_writer import RecordWriter
  for events in tensorboard.glob("events.out.tfevents.*"):
    records, torn = read_records(events.read_bytes())
    kept = [r for r in records if not _summary_after(event_pb2.Event.FromString(r), last_step)]
    if len(kept) < len(records) or torn:
      buffer = io.BytesIO()
      writer = RecordWriter(buffer)
      for record in kept:
        writer.write(record)
      write_atomically(events, lambda f: f.write(buffer.getvalue()))


def read_records(data: bytes) -> tuple[list[bytes], bool]:
  """(the records in a TFRecord file's bytes, whether a torn or corrupt record ends it).

  A record is <u64 length><u32 masked crc32c of the length><data><u32 masked crc32c of the
  data>; everything from the first bad record on is left out (a killed writer's tail).
  """
  # pylint: disable-next=import-outside-toplevel
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
  records, offset = [], 0
  while offset + 12 <= len(data):
    (length,), (length_crc,) = (struct.unpack_from("<Q", data, offset),
                                struct.unpack_from("<I", data, offset + 8))
    end = offset + 16 + length
    if length_crc != masked_crc32c(data[offset:offset + 8]) or end > len(data):
      break
    body = data[offset + 12:end - 4]
    if struct.unpack_from("<I", data, end - 4)[0] != masked_crc32c(body):
      break
    records.append(body)
    offset = end
  return records, offset < len(data)


def _summary_after(event, last_step: int) -> bool:
  """A summary after `last_step`, or the config at it (the resuming run writes it again)."""
  if not event.HasField("summary") or event.step < last_step:
    return False
  return event.step > last_step or any(v.tag == CONFIG_TAG for v in event.summary.value)


def make_writer(workdir: str, tensorboard: bool = True) -> MultiWriter:
  """metrics.jsonl (+ TensorBoard event files under <workdir>/tensorboard) on process 0."""
  if jax.process_index() != 0:
    return MultiWriter([])
  writers = [JsonlWriter(str(epath.Path(workdir) / METRICS_FILE))]
  if tensorboard:
    try:
      writers.append(TensorBoardWriter(str(epath.Path(workdir) / TENSORBOARD_DIR)))
    except ImportError as e:
      logging.warning("No TensorBoard event files (%s); metrics.jsonl is still written. "
                      "`pip install tensorboard` to get them.", e)
  return MultiWriter(writers)


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

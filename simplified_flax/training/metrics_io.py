"""A run's history: clu metric writers (TensorBoard + `metrics.jsonl`) and the progress line.

`<workdir>/metrics.jsonl` holds one JSON object per logged step, readable by any script:

    {"step": 50, "loss": 3.21, "learning_rate": 0.001, "grad_norm": 0.8,
     "tokens_per_s": 51200.0, "elapsed_s": 12.5}
    {"step": 250, "eval_loss": 2.9, "eval_perplexity": 18.2}
    {"step": 500, "kurtosis/layer_0": 0.4, "attn_entropy/layer_0": 2.1, "gain/h_0/...": 0.9}

(the last kind every `config.diagnostics_every` steps: the signal-propagation diagnostics, per
layer.)

On resume, rows after the restored step (written by the run that died) are dropped, so the
file reads as one uninterrupted run. Only process 0 writes.
"""
import contextlib
import json
import math
import os
import time
from typing import Any, Mapping

from absl import logging
from clu import metric_writers
import jax

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class JsonlWriter(metric_writers.MetricWriter):
  """A clu MetricWriter appending `{"step": step, **scalars}` rows to a JSON-lines file."""

  def __init__(self, path: str):
    self._file = open(path, "a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def read_history(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
  rows = []
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  return rows


def truncate_history(path: str, last_step: int) -> None:
  """Keeps the rows with step <= last_step (atomically rewrites the file)."""
  if not os.path.exists(path):
    return
  rows = [r for r in read_history(path) if r.get("step", 0) <= last_step]
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, path)


def make_writer(workdir: str, tensorboard: bool = True) -> metric_writers.MetricWriter:
  """metrics.jsonl (+ TensorBoard event files under <workdir>/tensorboard) on process 0."""
  if jax.process_index() != 0:
    return metric_writers.MultiWriter([])
  writers = [JsonlWriter(os.path.join(workdir, METRICS_FILE))]
  if tensorboard:
    try:
      from clu.metric_writers import SummaryWriter  # imports TensorFlow: slow, so only here
      writers.append(SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR)))
    except ImportError as e:
      logging.warning("No TensorBoard event files (%s); metrics.jsonl is still written. "
                      "`pip install tensorboard` to get them.", e)
  return metric_writers.MultiWriter(writers)


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

  def update(self, step: int) -> dict[str, float]:
    """{"tokens_per_s", "elapsed_s", "eta_s"} since the previous update (or the start).

    The first update's interval includes compilation.
    """
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

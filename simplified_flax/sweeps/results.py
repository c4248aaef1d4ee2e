"""What a finished run's workdir says: its final eval loss, throughput, time and size.

Read from `config.json` and `metrics.jsonl` alone (local or gs://), so a report can be rebuilt
from finished workdirs without training anything.
"""
import json
from typing import Any

import numpy as np

from simplified_flax import config_files
from simplified_flax import storage
from simplified_flax.runs import metrics_io


def history(workdir: str) -> list[dict]:
  return metrics_io.read_history(f"{workdir.rstrip('/')}/{metrics_io.METRICS_FILE}")


def is_finished(workdir: str, num_train_steps: int | None = None) -> bool:
  """Whether the run reached its last step's evaluation (the loop's final row). Without
  `num_train_steps`, the workdir's own config.json gives it."""
  if num_train_steps is None:
    path = f"{workdir.rstrip('/')}/{config_files.CONFIG_FILE}"
    if not storage.exists(path):
      return False
    num_train_steps = json.loads(storage.read_text(path))["num_train_steps"]
  return any(r.get("step") == num_train_steps and "eval_loss" in r for r in history(workdir))


def count_params(config_dict: dict) -> int:
  from simplified_flax.runs import compatibility  # pylint: disable=import-outside-toplevel
  return int(sum(np.prod(s) for s in compatibility.parameter_shapes(dict(config_dict)).values()))


def summarise(workdir: str) -> dict[str, Any]:
  """Final eval loss, final train loss (mean of the last 5 logged), median tokens/s (the first
  interval, which holds compilation, left out), train seconds, parameters, the history."""
  config_dict = json.loads(storage.read_text(f"{workdir.rstrip('/')}/{config_files.CONFIG_FILE}"))
  rows = history(workdir)
  train_rows = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  speeds = [r["tokens_per_s"] for r in train_rows[1:]] or [r["tokens_per_s"] for r in train_rows]
  tail = [r["loss"] for r in train_rows[-5:]]
  return {
      "workdir": workdir, "steps": config_dict["num_train_steps"],
      "params": count_params(config_dict),
      "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
      "final_train_loss": float(np.mean(tail)) if tail else None,
      "tokens_per_s": float(np.median(speeds)) if speeds else None,
      "train_s": train_rows[-1]["elapsed_s"] if train_rows else None,
      "history": rows, "config": config_dict,
  }


def final_eval_loss(workdir: str) -> float | None:
  evals = [r["eval_loss"] for r in history(workdir) if "eval_loss" in r]
  return evals[-1] if evals else None


def quantized_eval_file(workdir: str, scheme: str) -> str:
  """Where a sweep keeps `python -m simplified_flax.evaluate --quantize=scheme`'s JSON line."""
  return f"{workdir.rstrip('/')}/eval_{scheme}.json"


def write_quantized_eval(workdir: str, scheme: str, line: str) -> None:
  json.loads(line)   # a JSON object, or the caller's evaluation failed
  storage.write_atomically(quantized_eval_file(workdir, scheme), lambda f: f.write(line.encode()))


def quantized_eval(workdir: str, scheme: str) -> dict | None:
  path = quantized_eval_file(workdir, scheme)
  return json.loads(storage.read_text(path)) if storage.exists(path) else None


def peak_kurtosis(rows: list[dict]) -> float | None:
  """The largest activation kurtosis any layer logged over training (`kurtosis/layer_i`, the
  diagnostics of config.diagnostics_every), or None when none was logged."""
  values = [v for r in rows for k, v in r.items() if k.startswith("kurtosis/")]
  return max(values) if values else None

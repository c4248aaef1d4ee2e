"""Whether a checkpoint may resume under a new config: the two configs' differences by dotted
field, and the parameter shapes each describes. A change of shapes is refused naming the
model fields that cause it (IncompatibleCheckpointError); other changes are logged.
"""
import functools
import json
from typing import Any

from absl import logging
import jax
import ml_collections

from simplified_flax import config_files
from simplified_flax.model import parameters

# Fields that only say how this start resumes; they never make a checkpoint incompatible.
RESUME_ONLY_FIELDS = ("restore_step",)


class IncompatibleCheckpointError(ValueError):
  """The workdir holds checkpoints of a model with different parameter shapes."""


def flatten_config(d: dict) -> dict[str, Any]:
  """{"model": {"n_layer": 2}} -> {"model.n_layer": 2}."""
  return {k: v for k, v in config_files.dotted_items(d) if not isinstance(v, dict)}


def config_differences(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (saved value, new value)} for every field that differs."""
  a, b = flatten_config(saved), flatten_config(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def parameter_shapes(config_dict: dict) -> dict[str, tuple[int, ...]]:
  """{parameter path: shape} of the model a (saved, JSON) config dict describes; traced once
  per distinct model config (a restore compares each checkpoint it tries)."""
  return dict(_parameter_shapes(json.dumps(config_dict["model"], sort_keys=True)))


@functools.lru_cache(maxsize=32)
def _parameter_shapes(model_json: str) -> dict[str, tuple[int, ...]]:
  params = parameters.variable_shapes(ml_collections.ConfigDict(json.loads(model_json)))["params"]
  return {jax.tree_util.keystr(path): tuple(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def check_compatible(saved: dict, new: dict, where: str) -> None:
  """IncompatibleCheckpointError when `saved` and `new` shape parameters differently, naming
  the differing model fields that can (not numbers on both sides: rates and epsilons shape
  nothing); the other differences are logged."""
  diffs = config_differences(saved, new)
  model_diffs = [k for k in diffs if k.startswith("model.")]
  # {parameter path: (saved shape, new shape)} of the differing ones; a None shape is absent.
  shapes = model_diffs and config_differences(parameter_shapes(saved), parameter_shapes(new))
  if shapes:
    culprits = [k for k in model_diffs if not all(isinstance(v, float) for v in diffs[k])]
    listing = ", ".join(f"{k} (saved {diffs[k][0]!r}, now {diffs[k][1]!r})"
                        for k in culprits or model_diffs)
    path, (was, now) = next(iter(shapes.items()))
    was, now = ("absent" if shape is None else shape for shape in (was, now))
    raise IncompatibleCheckpointError(
        f"Refusing to resume from {where}: the new config changes parameter shapes through "
        f"{listing} (e.g. {path}: saved {was}, now {now}). Use a fresh --workdir, or set these "
        f"fields back.")
  others = {k: v for k, v in diffs.items() if k not in RESUME_ONLY_FIELDS}
  if others:
    logging.warning("Resuming with config changes that keep parameter shapes: %s",
                    ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in others.items()))

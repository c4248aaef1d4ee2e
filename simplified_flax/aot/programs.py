"""The train and eval steps of a config compiled for a target's devices, ahead of time.

    compiled = programs.compile_for(config, targets.parse("v5e-8"))
    compiled.train.memory_analysis(); compiled.train.as_text()     # XLA's, for the target

What is compiled is what `train` compiles: the same config checks (over the target's device
count), `Placement` (mesh and state shardings), train state and `loop.compile_steps`; only the
devices differ, and the state and batch are shapes (nothing is initialised or run). Every
hardware choice of the model follows the target's platform (fast/target_platform.py), so a
TPU program holds splash attention and an NVIDIA one cuDNN's, whatever this host is.
"""
import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from simplified_flax.aot import targets
from simplified_flax.data import tokenizers
from simplified_flax.runs import config_checks
from simplified_flax.training import loop
from simplified_flax.training import placement as placements
from simplified_flax.training.step import abstract_train_state

# TPU compilers refuse a program over the chip's memory with this status.
_TPU_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED.*?(Ran out of memory|exceeds available)",
                                re.S)
SHRINKING_KNOBS = ("parallel.fsdp", "parallel.shard_update", "batch_size", "grad_accum_steps",
                   "model.remat", "model.attention_impl", "model.loss_keep_logits")


DoesNotFitError = targets.DoesNotFitError   # raised here; defined where no JAX is imported


@dataclasses.dataclass
class CompiledSteps:
  """A config's steps compiled for `target` (jax.stages.Compiled), with what they were
  compiled against."""
  target: targets.Target
  config: Any                   # the config compiled (resolved; vocab_size set)
  devices: Any                  # the target's JAX devices
  placement: placements.JitPlacement
  abstract_state: Any           # the train state's leaves as ShapeDtypeStructs with shardings
  abstract_batch: dict          # one global batch, likewise
  train: Any
  eval: Any
  compile_s: float              # lowering + compiling both steps, seconds on this host


def compile_for(config, target: targets.Target) -> CompiledSteps:
  """`config`'s train and eval steps compiled for `target`. Raises ConfigError (as `train`
  would, for the target's device count), MissingBackendError, DoesNotFitError (TPU compilers
  check the memory; a GPU's is checked by the report)."""
  config = config.copy_and_resolve_references()
  devices = targets.topology_devices(target)
  config_checks.require(config.parallel.mode == "jit",
                        "parallel.mode='pmap' runs on this host's devices only; compile with "
                        "--config.parallel.mode=jit (the default).")
  config_checks.validate_run_config(config, len(devices))
  if config.model.vocab_size is None:
    config.model.vocab_size = tokenizers.nominal_vocab_size(config.data)
  placement = placements.Placement.from_config(config, devices)
  shapes = abstract_train_state(config)
  state = placement.restore_target(shapes)
  batch = abstract_batch(config, placements.batch_sharding(placement.mesh))
  train_fn, eval_fn, _ = loop.compile_steps(config, None, placement, shapes)
  start = time.perf_counter()
  try:
    train = train_fn.lower(state, batch).compile()
    eval_ = eval_fn.lower(state, batch).compile()
  except Exception as error:  # pylint: disable=broad-except
    found = _TPU_OUT_OF_MEMORY.search(str(error))
    if found:
      raise DoesNotFitError(does_not_fit_message(target, _first_line(str(error)))) from None
    raise
  return CompiledSteps(target, config, devices, placement, state, batch, train, eval_,
                       time.perf_counter() - start)


def abstract_batch(config, sharding) -> dict:
  """The global batch the pipeline hands the step, as ShapeDtypeStructs: decoder {"inputs"},
  encoder + "targets", "weights", "key_mask"; packed rows + "segment_ids"."""
  shape = (config.batch_size, config.model.context_length)
  spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  batch = {"inputs": spec(jnp.int32)}
  if config.model.kind == "encoder":
    batch.update(targets=spec(jnp.int32), weights=spec(jnp.float32), key_mask=spec(jnp.bool_))
  if config.data.packing:
    batch["segment_ids"] = spec(jnp.int32)
  return batch


def does_not_fit_message(target: targets.Target, needs: str) -> str:
  return (f"The step does not fit on {target.name}: {needs}. Shrink it with "
          f"{', '.join(SHRINKING_KNOBS)} (e.g. --config.parallel.fsdp=N shards the state, "
          f"--config.model.remat=true recomputes activations).")


def _first_line(text: str) -> str:
  found = re.search(r"(HLO temporaries|Ran out of memory|Program|Used)[^\n]*", text)
  return " ".join((found.group(0) if found else text.splitlines()[0]).split()).rstrip(".")

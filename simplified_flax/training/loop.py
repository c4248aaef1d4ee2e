"""The training loop: `train_and_evaluate(config, workdir)` trains a config to its last step in a
workdir, resuming from the latest good checkpoint there.

The workdir holds `config.json` (the resolved config), `metrics.jsonl` and `tensorboard/`
(metrics), and `checkpoints/`. SIGTERM (or a TPU preemption notice) saves at the next step and
returns. The pure steps it compiles live in `training/step.py`.
"""
import functools
import itertools
import json
import math
import os
import signal
import threading

import jax

from simplified_flax.training import checkpoints as checkpoint
from simplified_flax.training import metrics_io
from simplified_flax.training import placement as parallel
from simplified_flax.training.evaluation import CONFIG_FILE, run_eval
from simplified_flax.model.parameters import parameter_shapes, size
from simplified_flax.model.transformer import build_model
from simplified_flax.training.step import (StepSpec, TrainState, create_train_state,
                                        diagnostics_step, eval_step, train_step)

__all__ = ["create_train_state", "train_step", "eval_step", "diagnostics_step",
           "train_and_evaluate", "TrainState", "StepSpec", "NonFiniteLossError"]


# Without logging, metrics are still read (and checked for NaN) at least this often.
MAX_UNREAD_STEPS = 256


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm of a step was NaN or infinite; the run stopped before saving."""


class _StopRequest:
  """SIGTERM in a single-process run, or JAX's multi-host preemption sync point (TPU notices,
  SIGTERM on any host), asks the loop to save at the next step and return."""

  def __init__(self, manager):
    self._manager = manager
    self._flag = threading.Event()
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def requested(self, step: int) -> bool:
    # Called at every step on every host, as the multi-host sync protocol requires.
    return self._manager.reached_preemption(step) or self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _console(message: str) -> None:
  """The console progress/event line (process 0 only; absl logging carries the details)."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _write_config(workdir: str, config_dict: dict) -> None:
  if jax.process_index() == 0:
    tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(config_dict, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(workdir, CONFIG_FILE))


def train_and_evaluate(config, workdir: str, *, pipeline=None, model=None,
                       tensorboard: bool = True) -> TrainState:
  """Trains `config` to `config.num_train_steps` in `workdir`; returns the final state.

  `pipeline` defaults to `simplified_flax.data.build_pipeline(config, workdir=workdir)` and
  `model` to `build_model(config.model, dtype=config.dtype)`. `config.model.vocab_size` is
  set from the pipeline's tokenizer when None. Raises NonFiniteLossError naming the step of a
  NaN/inf loss (earlier checkpoints stay), and checkpoint.IncompatibleCheckpointError when the
  workdir's checkpoints have other parameter shapes.
  """
  # ----------------------------------------------------------------------------------------
  # Input and config.
  # ----------------------------------------------------------------------------------------
  os.makedirs(workdir, exist_ok=True)
  if pipeline is None:
    from simplified_flax.data import build_pipeline  # pylint: disable=import-outside-toplevel
    pipeline = parallel.primary_first(lambda: build_pipeline(config, workdir=workdir), "data")
  if config.model.vocab_size is None:
    config.model.vocab_size = pipeline.tokenizer.vocab_size
  config_dict = config.to_dict()
  tokens_per_step = config.batch_size * config.model.context_length

  # ----------------------------------------------------------------------------------------
  # Mesh and model state.
  # ----------------------------------------------------------------------------------------
  placement = parallel.Placement.from_config(config)
  placement.check_batch_size()
  state = create_train_state(config, jax.random.PRNGKey(config.seed), mesh=placement.mesh,
                             model=model)
  _console(f"Model: {size(state.params):,} parameters on {jax.device_count()} devices "
           f"({f'mesh {dict(placement.mesh.shape)}' if placement.mesh else 'pmap'}).")

  # ----------------------------------------------------------------------------------------
  # Checkpoint: resume from the latest good one.
  # ----------------------------------------------------------------------------------------
  manager = checkpoint.make_manager(workdir, config.max_to_keep, config.checkpoint_every_steps)
  abstract_state = jax.eval_shape(lambda s: s, state)
  restored = checkpoint.restore_latest(manager, placement.restore_target(abstract_state),
                                       config_dict, parameter_shapes, workdir)
  start_step, elapsed, data_state = 0, 0.0, None
  if restored is not None:
    state, data_state = restored.state, restored.data_state
    start_step, elapsed = restored.step, float(restored.meta.get("elapsed_s", 0.0))
    _console(f"Resuming from the checkpoint of step {start_step}.")
  if jax.process_index() == 0:
    metrics_io.truncate_history(os.path.join(workdir, metrics_io.METRICS_FILE), start_step)
  _write_config(workdir, config_dict)
  if placement.mode == "pmap":
    state = placement.shard_state(state)

  # ----------------------------------------------------------------------------------------
  # Compiled steps and input feeding.
  # ----------------------------------------------------------------------------------------
  train_fn = placement.compile_step(train_step, abstract_state)
  eval_fn = placement.compile_step(eval_step, abstract_state, returns_state=False)
  diagnostics_fn = None   # compiled, and dispatched, only when config.diagnostics_every > 0
  if config.diagnostics_every > 0:
    diagnostics_fn = placement.compile_step(_diagnostics_step(config, model), abstract_state,
                                            returns_state=False)
  iterator = pipeline.train_iterator()
  if data_state:
    iterator.set_state(data_state)
  feeder = parallel.Prefetcher(((next(iterator), iterator.get_state())
                                for _ in itertools.count()), placement.place_batch)

  # ----------------------------------------------------------------------------------------
  # Loop. Step s dispatches before step s-1's metrics are read; the host waits for the
  # device only to log, evaluate or checkpoint.
  # ----------------------------------------------------------------------------------------
  writer = metrics_io.make_writer(workdir, tensorboard)
  progress = metrics_io.Progress(total_steps=config.num_train_steps, start_step=start_step,
                                 tokens_per_step=tokens_per_step, elapsed_before=elapsed)
  stop = _StopRequest(manager)
  pending: list[tuple[int, dict]] = []   # (step, device metrics) not read yet
  pending_diagnostics: list[tuple[int, dict]] = []   # (step, diagnostics scalars) not read yet
  every = lambda s, n: n > 0 and s % n == 0      # n = 0: never (the last step still counts)
  is_log_step = lambda s: every(s, config.log_every_steps) or s == config.num_train_steps

  def read_pending() -> None:
    """Reads the pending metrics: stops on a non-finite one, writes the log steps' rows."""
    values = placement.host_metrics([m for _, m in pending])
    for (s, _), v in zip(pending, values):
      if not (math.isfinite(v["loss"]) and math.isfinite(v["grad_norm"])):
        raise NonFiniteLossError(
            f"Non-finite loss at step {s} (loss {v['loss']}, grad norm {v['grad_norm']}). "
            f"The last checkpoint (step {manager.latest_step()}) predates it; lower "
            f"optimizer.learning_rate or check the data before resuming.")
      if is_log_step(s):
        rates = progress.update(s)
        writer.write_scalars(s, {"loss": v["loss"], "learning_rate": v["learning_rate"],
                                 "grad_norm": v["grad_norm"],
                                 "tokens_per_s": rates["tokens_per_s"],
                                 "elapsed_s": rates["elapsed_s"]})
        _console(progress.line(s, float(v["loss"]), float(v["learning_rate"]), rates))
    pending.clear()
    values = placement.host_metrics([m for _, m in pending_diagnostics])
    for (s, _), v in zip(pending_diagnostics, values):
      writer.write_scalars(s, v)
    pending_diagnostics.clear()

  step, read_after_dispatch = start_step, False
  try:
    while step < config.num_train_steps:
      batch, data_state = next(feeder)
      state, metrics = train_fn(state, batch)
      step += 1
      if read_after_dispatch:
        read_pending()
        read_after_dispatch = False
      pending.append((step, metrics))
      if diagnostics_fn is not None and every(step, config.diagnostics_every):
        # The state after update `step`, on that update's batch; read after the next dispatch.
        pending_diagnostics.append((step, diagnostics_fn(state, batch)))

      preempted = stop.requested(step)
      last = step == config.num_train_steps
      save_now = preempted or last or every(step, config.checkpoint_every_steps)
      eval_now = config.eval_every_steps > 0 and (every(step, config.eval_every_steps) or last)
      if save_now or eval_now:
        read_pending()   # never checkpoint or evaluate past an unchecked loss
      elif is_log_step(step) or len(pending) >= MAX_UNREAD_STEPS or pending_diagnostics:
        read_after_dispatch = True
      if eval_now:
        with progress.paused():
          result = run_eval(eval_fn, state, pipeline.eval_batches(config.eval_steps), placement)
        writer.write_scalars(step, {k: result[k] for k in ("eval_loss", "eval_perplexity",
                                                            "eval_mlm_accuracy") if k in result})
        accuracy = result.get("eval_mlm_accuracy")
        _console(f"step {step} | eval loss {result['eval_loss']:.4f} | "
                 f"eval perplexity {result['eval_perplexity']:.3f}"
                 + ("" if accuracy is None else f" | eval MLM accuracy {accuracy:.3f}"))
      if save_now:
        with progress.paused():
          checkpoint.save(manager, step, placement.host_state(state), data_state, config_dict,
                          {"elapsed_s": progress.elapsed()})
      if preempted:
        _console(f"Stop requested: saved the checkpoint of step {step}; exiting.")
        break
    if pending or pending_diagnostics:
      read_pending()
  finally:
    feeder.close()
    iterator_close = getattr(iterator, "close", None)
    if iterator_close is not None:
      iterator_close()
    stop.close()
    manager.wait_until_finished()
    manager.close()
    writer.close()
  return state


def _diagnostics_step(config, model):
  """`diagnostics_step` on the explicit attention path, whose softmax gives the entropy: a
  fused config's model is rebuilt as explicit (same parameters). A caller's own `model` is
  used as it is (no entropy if it sows no probabilities)."""
  if model is not None or config.model.attention_impl == "explicit":
    return diagnostics_step
  explicit = config.model.copy_and_resolve_references()
  explicit.attention_impl = "explicit"
  return functools.partial(diagnostics_step,
                           apply_fn=build_model(explicit, dtype=config.dtype).apply)


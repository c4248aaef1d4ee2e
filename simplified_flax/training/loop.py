"""The training loop: `train_and_evaluate(config, workdir)` trains a config to its last step in a
workdir, resuming from the latest good checkpoint there.

The workdir holds `config.json` (the resolved config), `metrics.jsonl` and `tensorboard/`
(metrics), and `checkpoints/`. SIGTERM (or a TPU preemption notice) saves at the next step and
returns. The pure steps it compiles live in `training/step.py`.
"""
import functools
import itertools
import json
import signal
import threading

from etils import epath
import jax

from simplified_flax import storage
from simplified_flax.data.prefetch import Prefetcher
from simplified_flax.runs import checkpoints
from simplified_flax.runs import config_checks
from simplified_flax.runs import data_preflight
from simplified_flax.runs import metrics_io
from simplified_flax.runs import nonfinite
from simplified_flax.training import placement as parallel
from simplified_flax.runs import resume_changes
from simplified_flax.runs import rewind
from simplified_flax.runs import workdir_lock
from simplified_flax.runs.nonfinite import NonFiniteLossError
from simplified_flax.training.evaluation import CONFIG_FILE, run_eval
from simplified_flax.model.parameters import parameter_shapes, size
from simplified_flax.model.transformer import build_model
from simplified_flax.training.step import (StepSpec, TrainState, create_train_state,
                                        diagnostics_step, eval_step, train_step)

__all__ = ["create_train_state", "train_step", "eval_step", "diagnostics_step",
           "train_and_evaluate", "TrainState", "StepSpec", "NonFiniteLossError"]


# Without logging, metrics are still read (and checked for NaN) at least this often.
MAX_UNREAD_STEPS = 256


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
  """Process 0 writes config.json (through epath: the workdir may be gs://...)."""
  if jax.process_index() == 0:
    text = json.dumps(config_dict, indent=2, sort_keys=True).encode()
    storage.write_atomically(epath.Path(workdir) / CONFIG_FILE, lambda f: f.write(text))


def train_and_evaluate(config, workdir: str, *, pipeline=None, model=None,
                       tensorboard: bool = True) -> TrainState:
  """Trains `config` to `config.num_train_steps` in `workdir`; returns the final state.

  `pipeline` defaults to `simplified_flax.data.build_pipeline(config, workdir=workdir)` and
  `model` to `build_model(config.model, dtype=config.dtype)`. `config.model.vocab_size` is
  set from the pipeline's tokenizer when None. The whole config is checked first (ConfigError,
  nothing written); then the workdir is locked for the run (WorkdirLockedError while another
  live run holds it). Raises NonFiniteLossError naming the step of a NaN/inf loss, the kept
  checkpoints and the command to rewind to one (`config.restore_step`, see runs/rewind.py),
  and checkpoints.IncompatibleCheckpointError when the workdir's checkpoints have other
  parameter shapes.
  """
  config_checks.validate_run_config(config, jax.device_count())
  if pipeline is None:
    data_preflight.check_tfds_available(config.data)   # seconds, not tfds's minutes of retries
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)   # the lock file lives there
  with workdir_lock.hold(workdir):
    return _train(config, workdir, pipeline=pipeline, model=model, tensorboard=tensorboard)


def _train(config, workdir: str, *, pipeline, model, tensorboard: bool) -> TrainState:
  """`train_and_evaluate` once the config is checked and the workdir is locked."""
  # ----------------------------------------------------------------------------------------
  # Input and config.
  # ----------------------------------------------------------------------------------------
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
  state = create_train_state(config, jax.random.PRNGKey(config.seed), mesh=placement.mesh,
                             model=model)
  _console(f"Model: {size(state.params):,} parameters on {jax.device_count()} devices "
           f"({f'mesh {dict(placement.mesh.shape)}' if placement.mesh else 'pmap'}).")

  # ----------------------------------------------------------------------------------------
  # Checkpoint: resume from the latest good one.
  # ----------------------------------------------------------------------------------------
  manager = checkpoints.make_manager(workdir, config.max_to_keep, config.checkpoint_every_steps,
                                    keep_every_steps=config.keep_every_steps)
  abstract_state = jax.eval_shape(lambda s: s, state)
  rewind_to, later_steps = rewind.plan(manager, config.restore_step)
  restored = None
  if rewind_to != 0:   # 0: start over, so nothing to restore
    restored = checkpoints.restore_latest(manager, placement.restore_target(abstract_state),
                                         config_dict, parameter_shapes, workdir, step=rewind_to)
  if rewind_to is not None:   # only once the step to rewind to has read back intact
    rewind.set_aside(workdir, manager, rewind_to, later_steps)
  start_step, elapsed, data_state = 0, 0.0, None
  if restored is not None:
    state, data_state = restored.state, restored.data_state
    start_step, elapsed = restored.step, float(restored.meta.get("elapsed_s", 0.0))
    _console(f"Resuming from the checkpoint of step {start_step}.")
    schedule_note = resume_changes.schedule_change(restored.config, config_dict, start_step)
    if schedule_note:
      _console(schedule_note)
  if jax.process_index() == 0:
    metrics_io.truncate_history(workdir, start_step)
  _write_config(workdir, config_dict)
  state = placement.shard_state(state)   # pmap: one copy per device; jit: already in place

  # ----------------------------------------------------------------------------------------
  # Compiled steps and input feeding.
  # ----------------------------------------------------------------------------------------
  train_fn = placement.compile_step(train_step, abstract_state)
  eval_fn = placement.compile_step(eval_step, abstract_state, returns_state=False)
  diagnostics_fn = None   # compiled, and dispatched, only when config.diagnostics_every > 0
  if config.diagnostics_every > 0:
    diagnostics_fn = placement.compile_step(_diagnostics_step(config, model), abstract_state,
                                            returns_state=False)
  iterator = pipeline.train_iterator(prefetch=0)   # `feeder` is the one prefetch thread, if any
  if data_state:
    iterator.set_state(data_state)
  # Each batch travels with the iterator state after it, so a checkpoint records the data
  # position of the step it saves, however far ahead the thread runs.
  feeder = Prefetcher(((next(iterator), iterator.get_state()) for _ in itertools.count()),
                      transform=lambda item: (placement.place_batch(item[0]), item[1]),
                      depth=config.data.prefetch)   # 0: made in this thread, no other

  # ----------------------------------------------------------------------------------------
  # Loop. Step s dispatches before step s-1's metrics are read; the host waits for the
  # device only to log, evaluate or checkpoint.
  # ----------------------------------------------------------------------------------------
  writer = metrics_io.make_writer(workdir, tensorboard)
  writer.write_config(start_step, config_dict)   # TensorBoard's Text tab
  progress = metrics_io.Progress(total_steps=config.num_train_steps, start_step=start_step,
                                 tokens_per_step=tokens_per_step, elapsed_before=elapsed)
  stop = _StopRequest(manager)
  pending: list[tuple[int, dict]] = []   # (step, device metrics) not read yet
  pending_diagnostics: list[tuple[int, dict]] = []   # (step, diagnostics) not read yet
  every = lambda s, n: n > 0 and s % n == 0      # n = 0: never (the last step still counts)
  is_log_step = lambda s: every(s, config.log_every_steps) or s == config.num_train_steps

  def read_pending() -> None:
    """Reads the pending metrics: stops on a non-finite one, writes the log steps' rows."""
    values = placement.host_metrics([m for _, m in pending])
    try:
      nonfinite.check_finite(zip([s for s, _ in pending], values))
    except NonFiniteLossError as error:
      manager.wait_until_finished()   # the kept steps, once any save in flight is complete
      raise NonFiniteLossError(f"{error} {nonfinite.resume_advice(workdir, manager.all_steps())}"
                               ) from None
    for (s, _), v in zip(pending, values):
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
      if step == start_step + 1:
        progress.restart_clock()   # the first call compiled: keep it out of tokens/s and ETA
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
          writer.flush()   # the history up to a checkpoint outlives a kill (remote: rewritten)
          checkpoints.save(manager, step, placement.host_state(state), data_state, config_dict,
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
    manager.wait_until_finished()
    manager.close()
    writer.close()
    stop.close()   # last: a SIGTERM during the final save waits for it instead of cutting it
  return state


def _diagnostics_step(config, model):
  """`diagnostics_step` on the explicit attention path, whose softmax gives the entropy: a
  fused config's model is rebuilt as explicit (same parameters; "auto" takes the explicit
  path by itself while intermediates are collected). A caller's own `model` is used as it is
  (no entropy if it sows no probabilities)."""
  if model is not None or config.model.attention_impl in ("explicit", "auto"):
    return diagnostics_step
  explicit = config.model.copy_and_resolve_references()
  explicit.attention_impl = "explicit"
  return functools.partial(diagnostics_step,
                           apply_fn=build_model(explicit, dtype=config.dtype).apply)


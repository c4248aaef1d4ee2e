"""The training loop: `train_and_evaluate(config, workdir)` compiles the pure steps of step.py
and calls the run operations of `simplified_flax/runs/` by name.
"""
import itertools
import json

from etils import epath
import jax

from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.config_files import CONFIG_FILE
from simplified_flax.data.pipeline import shard_root
from simplified_flax.data.prefetch import Prefetcher
from simplified_flax.runs import checkpoints
from simplified_flax.runs import config_checks
from simplified_flax.runs import data_preflight
from simplified_flax.runs import metrics_io
from simplified_flax.runs import nonfinite
from simplified_flax.runs import resume
from simplified_flax.runs import workdir_lock
from simplified_flax.runs.nonfinite import NonFiniteLossError
from simplified_flax.training.evaluation import input_pipeline, run_eval
from simplified_flax.training.placement import Placement
from simplified_flax.model.parameters import size
from simplified_flax.model.transformer import build_model
from simplified_flax.training.step import (TrainState, create_train_state, diagnostics_step,
                                           eval_step, train_step)


# Without logging, metrics are still read (and checked for NaN) at least this often.
MAX_UNREAD_STEPS = 256


def _console(message: str) -> None:
  """A progress or event line on the console (process 0 only)."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _write_config(workdir: str, config_dict: dict) -> None:
  """Process 0 writes config.json (through epath: the workdir may be gs://...)."""
  if jax.process_index() == 0:
    text = json.dumps(config_dict, indent=2, sort_keys=True).encode()
    storage.write_atomically(epath.Path(workdir) / CONFIG_FILE, lambda f: f.write(text))


def _every(step: int, n: int) -> bool:
  """Whether `step` is a multiple of `n`; n = 0: never (the last step still counts)."""
  return n > 0 and step % n == 0


def train_and_evaluate(config, workdir: str, *, pipeline=None, model=None,
                       tensorboard: bool = True) -> TrainState:
  """Trains `config` to `config.num_train_steps` in `workdir` (`config.json`, `metrics.jsonl`,
  `tensorboard/`, `checkpoints/`), resuming from its latest good checkpoint; SIGTERM (or a TPU
  preemption notice) saves at the next step and returns. Returns the final state.

  `pipeline` defaults to `data.build_pipeline(config, workdir=workdir)` (its tokenizer sets a
  None `model.vocab_size`), `model` to `build_model(config.model, config.dtype)`. Raises
  ConfigError before anything is written, WorkdirLockedError while another run holds the
  workdir, NonFiniteLossError naming the step and how to rewind (`config.restore_step`).
  """
  config_checks.validate_run_config(config, jax.device_count())
  retries.configure_from(config, workdir, shard_root(config.data))
  if pipeline is None:
    data_preflight.check_tfds_available(config.data)   # seconds, not tfds's minutes of retries
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)   # the lock file lives there
  with workdir_lock.hold(workdir):
    return _train(config, workdir, pipeline=pipeline, model=model, tensorboard=tensorboard)


def _train(config, workdir: str, *, pipeline, model, tensorboard: bool) -> TrainState:
  """`train_and_evaluate` once the config is checked and the workdir is locked."""
  pipeline = input_pipeline(config, workdir, pipeline)   # sets a None vocab_size
  config_dict = config.to_dict()

  # Mesh and model state; resume from the latest good checkpoint (or rewind to restore_step).
  placement = Placement.from_config(config)
  state = create_train_state(config, jax.random.PRNGKey(config.seed), mesh=placement.mesh,
                             model=model)
  _console(f"Model: {size(state.params):,} parameters on {jax.device_count()} devices "
           f"({f'mesh {dict(placement.mesh.shape)}' if placement.mesh else 'pmap'}).")
  manager = checkpoints.make_manager(workdir, config.max_to_keep, config.checkpoint_every_steps,
                                     keep_every_steps=config.keep_every_steps)
  abstract_state = jax.eval_shape(lambda s: s, state)
  start = resume.start(workdir, manager, placement.restore_target(abstract_state), config_dict,
                       config.restore_step)
  for note in start.notes:
    _console(note)
  _write_config(workdir, config_dict)
  # pmap: one copy per device; jit: already in place.
  state = placement.shard_state(state if start.state is None else start.state)

  # Compiled steps, input feeding, the run's history.
  train_fn, eval_fn, diagnostics_fn = compile_steps(config, model, placement, abstract_state)
  iterator, feeder = _feed(pipeline, placement, start.data_state, config.data.prefetch)
  writer = metrics_io.MetricsWriter(workdir, tensorboard, start.step, config_dict)
  progress = metrics_io.Progress(total_steps=config.num_train_steps, start_step=start.step,
                                 tokens_per_step=config.batch_size * config.model.context_length,
                                 elapsed_before=start.elapsed_s)
  stop = checkpoints.StopRequest(manager)
  pending = _PendingMetrics(config, workdir, placement, manager, writer, progress)

  # Step s dispatches before step s-1's metrics are read; the host waits for the device only
  # to log, evaluate or checkpoint.
  step, read_after_dispatch = start.step, False
  try:
    while step < config.num_train_steps:
      batch, data_state = next(feeder)
      state, metrics = train_fn(state, batch)
      step += 1
      if step == start.step + 1:
        progress.restart_clock()   # the first call compiled: keep it out of tokens/s and ETA
      if read_after_dispatch:
        pending.read()
        read_after_dispatch = False
      pending.steps.append((step, metrics))
      if diagnostics_fn is not None and _every(step, config.diagnostics_every):
        # The state after update `step`, on that update's batch; read after the next dispatch.
        pending.diagnostics.append((step, diagnostics_fn(state, batch)))

      preempted = stop.requested(step)
      last = step == config.num_train_steps
      save_now = preempted or last or _every(step, config.checkpoint_every_steps)
      eval_now = config.eval_every_steps > 0 and (_every(step, config.eval_every_steps) or last)
      if save_now or eval_now:
        pending.read()   # never checkpoint or evaluate past an unchecked loss
      elif pending.due(step):
        read_after_dispatch = True
      if eval_now:
        _evaluate(step, eval_fn, state, pipeline, config, placement, writer, progress)
      if save_now:
        with progress.paused():
          writer.flush()   # the history up to a checkpoint outlives a kill (remote: rewritten)
          checkpoints.save(manager, step, placement.host_state(state), data_state, config_dict,
                           {"elapsed_s": progress.elapsed()})
      if preempted:
        _console(f"Stop requested: saved the checkpoint of step {step}; exiting.")
        break
    if pending.steps or pending.diagnostics:
      pending.read()
  finally:
    _close(feeder, iterator, manager, writer, stop)
  return state


class _PendingMetrics:
  """The (step, device metrics) of dispatched steps not read yet: reading waits for the device,
  so the loop reads only to log, evaluate or checkpoint, or every `MAX_UNREAD_STEPS` steps."""

  def __init__(self, config, workdir: str, placement, manager, writer, progress):
    self._config, self._workdir, self._placement = config, workdir, placement
    self._manager, self._writer, self._progress = manager, writer, progress
    self.steps: list[tuple[int, dict]] = []          # train-step metrics
    self.diagnostics: list[tuple[int, dict]] = []    # diagnostics scalars

  def is_log_step(self, step: int) -> bool:
    return _every(step, self._config.log_every_steps) or step == self._config.num_train_steps

  def due(self, step: int) -> bool:
    """Whether to read after the next dispatch (a log step, too many unread, diagnostics)."""
    return (self.is_log_step(step) or len(self.steps) >= MAX_UNREAD_STEPS
            or bool(self.diagnostics))

  def read(self) -> None:
    """Reads the pending metrics: stops on a non-finite one, writes the log steps' rows."""
    values = self._placement.host_metrics([m for _, m in self.steps])
    try:
      nonfinite.check_finite(zip([s for s, _ in self.steps], values))
    except NonFiniteLossError as error:
      checkpoints.finish(self._manager)   # the kept steps, once any save in flight is done
      advice = nonfinite.resume_advice(self._workdir, self._manager.all_steps())
      raise NonFiniteLossError(f"{error} {advice}") from None
    for (s, _), v in zip(self.steps, values):
      if self.is_log_step(s):
        rates = self._progress.update(s)
        self._writer.write_scalars(s, {"loss": v["loss"], "learning_rate": v["learning_rate"],
                                       "grad_norm": v["grad_norm"],
                                       "tokens_per_s": rates["tokens_per_s"],
                                       "elapsed_s": rates["elapsed_s"]})
        _console(self._progress.line(s, float(v["loss"]), float(v["learning_rate"]), rates))
    self.steps.clear()
    values = self._placement.host_metrics([m for _, m in self.diagnostics])
    for (s, _), v in zip(self.diagnostics, values):
      self._writer.write_scalars(s, v)
    self.diagnostics.clear()


def compile_steps(config, model, placement, abstract_state):
  """(train, eval, diagnostics) steps compiled for `placement`; diagnostics is None unless
  `config.diagnostics_every` > 0."""
  train_fn = placement.compile_step(train_step, abstract_state)
  eval_fn = placement.compile_step(eval_step, abstract_state, returns_state=False)
  diagnostics_fn = None
  if config.diagnostics_every > 0:
    diagnostics_fn = placement.compile_step(_diagnostics_step(config, model), abstract_state,
                                            returns_state=False)
  return train_fn, eval_fn, diagnostics_fn


def _feed(pipeline, placement, data_state, depth: int):
  """(iterator at `data_state`, feeder of (placed batch, iterator state after it)): a
  checkpoint records the data position of its step however far ahead the thread runs."""
  iterator = pipeline.train_iterator(prefetch=0)   # `feeder` is the one prefetch thread, if any
  if data_state:
    iterator.set_state(data_state)
  feeder = Prefetcher(((next(iterator), iterator.get_state()) for _ in itertools.count()),
                      transform=lambda item: (placement.place_batch(item[0]), item[1]),
                      depth=depth)   # 0: made in this thread, no other
  return iterator, feeder


def _evaluate(step: int, eval_fn, state, pipeline, config, placement, writer, progress) -> None:
  """Evaluates `state` on `config.eval_steps` batches off the progress clock; logs the result."""
  with progress.paused():
    result = run_eval(eval_fn, state, pipeline.eval_batches(config.eval_steps), placement)
  writer.write_scalars(step, {k: result[k] for k in ("eval_loss", "eval_perplexity",
                                                      "eval_mlm_accuracy") if k in result})
  accuracy = result.get("eval_mlm_accuracy")
  _console(f"step {step} | eval loss {result['eval_loss']:.4f} | "
           f"eval perplexity {result['eval_perplexity']:.3f}"
           + ("" if accuracy is None else f" | eval MLM accuracy {accuracy:.3f}"))


def _close(feeder, iterator, manager, writer, stop) -> None:
  """Stops the input thread, finishes any save in flight, closes the writers, and the stop
  request last (a SIGTERM during the final save waits for it)."""
  feeder.close()
  if hasattr(iterator, "close"):   # the data pipeline's own prefetch thread, if any
    iterator.close()
  checkpoints.finish(manager)
  manager.close()
  writer.close()
  stop.close()


def _diagnostics_step(config, model):
  """`diagnostics_step` on the explicit attention path, whose softmax gives the entropy: a fused
  config's model is rebuilt as explicit (same parameters). A caller's `model` is kept."""
  if model is not None or config.model.attention_impl != "fused":
    return diagnostics_step
  explicit = config.model.copy_and_resolve_references()
  explicit.attention_impl = "explicit"
  apply_fn = build_model(explicit, dtype=config.dtype).apply
  return lambda state, batch, axis_name=None: diagnostics_step(state.replace(apply_fn=apply_fn),
                                                               batch)

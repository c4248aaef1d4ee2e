"""The core runs without TensorFlow: with `tensorflow` and `tensorflow_datasets` made
unimportable (blocked in sys.modules, in a child process), the model, the train step, the
optimiser, the Orbax checkpoint save/restore, a resume's cut of the metrics history and
TensorBoard events (as TensorBoard reads them), decoding, the configs and the benchmark
import and run. A user with their own data loader (here: random tokens) never needs
TensorFlow."""
import subprocess
import sys
import textwrap

from test_loop import REPO, subprocess_env

CHILD = textwrap.dedent('''
    import sys
    # None in sys.modules is Python's own import block: `import tensorflow` raises
    # ImportError and importlib.util.find_spec("tensorflow") answers None, as when absent.
    for name in ("tensorflow", "tensorflow_datasets"):
      sys.modules[name] = None

    import jax, numpy as np
    import configs
    from simplified_flax import benchmark, evaluate, prepare, sample, train  # entry points
    import experiments.benchmark   # noqa: F401  (the benchmark's timing core)
    import simplified_flax.data   # noqa: F401  (tf and tfds only inside the tfds corpus reader)
    from simplified_flax.model import decode                   # noqa: F401
    from simplified_flax.runs import checkpoints, metrics_io
    from simplified_flax.training.step import create_train_state, train_step

    workdir = sys.argv[1]
    config = configs.load("sas_p:cpu", {"model.n_layer": 2, "model.n_embd": 32,
                                        "model.n_head": 2, "model.context_length": 16,
                                        "model.vocab_size": 64, "batch_size": 4})
    state = create_train_state(config, jax.random.PRNGKey(0))
    batch = {"inputs": np.random.default_rng(0).integers(0, 64, (4, 16), dtype=np.int32)}
    state, metrics = jax.jit(train_step)(state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1

    writer = metrics_io.MetricsWriter(workdir)                # metrics.jsonl + TensorBoard
    for step in (1, 2):
      writer.write_scalars(step, {"loss": float(step)})
    writer.close()
    metrics_io.cut_history(workdir, 1)          # what a resume from step 1 does
    writer = metrics_io.MetricsWriter(workdir, start_step=1)
    writer.write_scalars(2, {"loss": 0.5})
    writer.close()
    from tensorboard.backend.event_processing import event_accumulator
    events = event_accumulator.EventAccumulator(f"{workdir}/tensorboard")
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]
    config_dict = config.to_dict()
    manager = checkpoints.make_manager(workdir, 2, 1)
    checkpoints.save(manager, 1, state, {}, config_dict, {})
    manager.wait_until_finished()
    target = jax.eval_shape(lambda s: s, state)
    restored = checkpoints.restore_latest(manager, target, config_dict, workdir)
    manager.close()
    assert restored.step == 1
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
      assert np.array_equal(np.asarray(a), np.asarray(b))
    blocked = sorted(m for m, module in sys.modules.items() if module is not None
                     and m.split(".")[0] in ("tensorflow", "tensorflow_datasets"))
    assert not blocked, blocked
    print("core ran without TensorFlow")
''')


def test_init_train_step_checkpoint_without_tensorflow(tmp_path):
  child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run")], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert child.returncode == 0, child.stderr[-3000:]
  assert "core ran without TensorFlow" in child.stdout
  assert (tmp_path / "run" / "metrics.jsonl").read_text().startswith('{"step": 1,')

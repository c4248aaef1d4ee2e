"""The pure training API: create_train_state, train_step, eval_step and the token losses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from conftest import TINY_MODEL
from simplified_flax.training import losses
from simplified_flax.train import create_train_state, eval_step, train_step

B, T, V = 8, 16, 61


def _config(variant="preln", arg="", **overrides):
  tiny = {f"model.{key}": value for key, value in TINY_MODEL.items()}
  return configs.load(f"{variant}:{arg}", {
      **tiny, "batch_size": B, "num_train_steps": 100, "optimizer.schedule": "constant",
      "optimizer.warmup_steps": 0, "optimizer.learning_rate": 3e-3, **overrides})


def _tokens(seed=0, rows=B):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, size=(rows, T)), jnp.int32)


@pytest.fixture(scope="module")
def preln():
  config = _config()
  return config, create_train_state(config, jax.random.PRNGKey(0)), jax.jit(train_step)


def test_train_state_layout():
  config = _config("sas")
  state = create_train_state(config, jax.random.key(0))   # typed keys are accepted too
  assert int(state.step) == 0
  assert state.rng.dtype == jnp.uint32 and state.rng.shape == (2,)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  # SAS keeps its fixed value anchor next to (not inside) the trained parameters.
  assert "anchors" in state.constants["constants"]
  assert "anchors" not in jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(state.params))
  assert state.spec.kind == "decoder" and state.spec.grad_accum_steps == 1


def test_unset_vocab_size_is_an_error():
  config = _config()
  config.model.vocab_size = None
  with pytest.raises(ValueError, match="vocab_size"):
    create_train_state(config, jax.random.PRNGKey(0))


def test_training_reduces_the_loss_and_counts_steps(preln):
  _, state, step = preln
  batch = {"inputs": _tokens()}
  first = None
  for _ in range(8):
    state, metrics = step(state, batch)
    first = float(metrics["loss"]) if first is None else first
  assert int(state.step) == 8
  assert float(metrics["loss"]) < first - 0.1
  assert float(metrics["learning_rate"]) == pytest.approx(3e-3)
  assert np.isfinite(float(metrics["grad_norm"]))


def test_train_step_is_pure(preln):
  _, state, step = preln
  batch = {"inputs": _tokens(1)}
  (s1, m1), (s2, m2) = step(state, batch), step(state, batch)
  assert float(m1["loss"]) == float(m2["loss"])
  jax.tree.map(np.testing.assert_array_equal, s1.params, s2.params)


def test_eval_step_sums_match_the_train_loss(preln):
  _, state, step = preln
  batch = {"inputs": _tokens(2)}
  sums = jax.jit(eval_step)(state, batch)
  _, metrics = step(state, batch)
  assert float(sums["weight_sum"]) == B * (T - 1)
  np.testing.assert_allclose(float(sums["loss_sum"] / sums["weight_sum"]),
                             float(metrics["loss"]), rtol=1e-6)


def test_gradient_accumulation_equals_one_big_batch(preln):
  _, s1, step = preln                      # grad_accum_steps=1
  s4 = create_train_state(_config(grad_accum_steps=4), jax.random.PRNGKey(0))
  assert s4.spec.grad_accum_steps == 4
  batch = {"inputs": _tokens(3)}
  for _ in range(2):
    s1, m1 = step(s1, batch)
    s4, m4 = jax.jit(train_step)(s4, batch)
  np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), s4.params, s1.params)


def test_packed_rows_are_not_scored_across_documents():
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 0, 0]])
  logits = jax.random.normal(jax.random.PRNGKey(0), (1, 7, 5))
  inputs = jnp.array([[1, 2, 3, 4, 0, 0, 0]])
  _, weights = losses.targets_and_weights_BT({"inputs": inputs, "segment_ids": segment_ids},
                                             "decoder")
  np.testing.assert_array_equal(weights, [[1, 1, 0, 1, 0, 0, 0]])
  sums = losses.loss_sums(logits, {"inputs": inputs, "segment_ids": segment_ids}, "decoder")
  ce = losses.cross_entropy_BT(logits[:, :-1], inputs[:, 1:])
  assert float(sums["weight_sum"]) == 3
  np.testing.assert_allclose(float(sums["loss_sum"]), float(ce[0, 0] + ce[0, 1] + ce[0, 3]),
                             rtol=1e-6)


def test_packed_decoder_batch_is_scored_per_document(preln):
  _, state, _ = preln
  segment_ids = jnp.asarray(np.repeat([[1] * 6 + [2] * 7 + [0] * 3], B, axis=0), jnp.int32)
  batch = {"inputs": _tokens(4), "segment_ids": segment_ids}
  sums = jax.jit(eval_step)(state, batch)
  assert float(sums["weight_sum"]) == B * (5 + 6)
  assert np.isfinite(float(sums["loss_sum"]))


def test_encoder_mlm_step_scores_only_weighted_positions():
  config = _config("preln", "encoder")
  state = create_train_state(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(5)
  weights = (rng.random((B, T)) < 0.25).astype(np.float32)
  batch = {"inputs": _tokens(5), "targets": _tokens(6), "weights": jnp.asarray(weights),
           "key_mask": jnp.ones((B, T), bool)}
  sums = jax.jit(eval_step)(state, batch)
  assert float(sums["weight_sum"]) == weights.sum()
  logits = jax.jit(lambda s, b: s.apply_fn({"params": s.params, **s.constants}, b["inputs"],
                                           key_mask=b["key_mask"]))(state, batch)
  ce = losses.cross_entropy_BT(logits, batch["targets"])
  np.testing.assert_allclose(float(sums["loss_sum"]), float(jnp.sum(ce * weights)), rtol=1e-5)
  new_state, metrics = jax.jit(train_step)(state, batch)
  assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_bfloat16_compute_keeps_float32_master_weights(preln):
  _, f32_state, f32_step = preln
  config = _config(dtype="bfloat16")
  state = create_train_state(config, jax.random.PRNGKey(0))
  batch = {"inputs": _tokens(7)}
  new_state, metrics = jax.jit(train_step)(state, batch)
  for tree in (new_state.params, new_state.opt_state):
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(tree))
  _, f32_metrics = f32_step(f32_state, batch)   # the same initial weights in float32
  np.testing.assert_allclose(float(metrics["loss"]), float(f32_metrics["loss"]), rtol=2e-2)

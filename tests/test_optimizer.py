"""Optimiser: schedules, the weight-decay mask on real model trees, AdamW, Muon, clipping,
accumulation."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax.training import optimizer
from simplified_flax.model.transformer import build_model


def _opt(**overrides):
  o = ml_collections.ConfigDict(dict(learning_rate=1.0, schedule="linear", warmup_fraction=0.05,
                                     warmup_steps=None, weight_decay=0.1, b1=0.9, b2=0.999,
                                     eps=1e-8, grad_clip_norm=1.0))
  o.update(overrides)
  return o


def _lr(opt, total, steps):
  schedule = optimizer.make_schedule(opt, total)
  return np.array([float(schedule(s)) for s in steps])


# ------------------------------------------------------------------------------------------
# Schedules.
# ------------------------------------------------------------------------------------------
def test_warmup_steps_from_fraction_or_explicit():
  assert optimizer.warmup_steps(_opt(), 1000) == 50          # the paper's 5%
  assert optimizer.warmup_steps(_opt(warmup_steps=7), 1000) == 7
  assert optimizer.warmup_steps(_opt(warmup_fraction=0.0), 1000) == 0


def test_linear_schedule_warms_up_then_decays_to_zero():
  lr = _lr(_opt(), 100, [0, 1, 5, 50, 95, 100, 120])   # warm-up 5 steps
  np.testing.assert_allclose(lr, [0.0, 0.2, 1.0, 1 - 45 / 95, 1 - 90 / 95, 0.0, 0.0], atol=1e-6)


def test_cosine_rsqrt_constant_schedules():
  cos = _lr(_opt(schedule="cosine", warmup_steps=10), 110, [5, 10, 60, 110])
  np.testing.assert_allclose(cos, [0.5, 1.0, 0.5, 0.0], atol=1e-6)
  rsqrt = _lr(_opt(schedule="rsqrt", warmup_steps=10), 1000, [5, 10, 40, 90])
  np.testing.assert_allclose(rsqrt, [0.5, 1.0, 0.5, 1 / 3], atol=1e-6)
  const = _lr(_opt(schedule="constant", warmup_steps=4), 100, [2, 4, 99])
  np.testing.assert_allclose(const, [0.5, 1.0, 1.0], atol=1e-6)
  no_warm = _lr(_opt(schedule="rsqrt", warmup_steps=0), 100, [0, 1, 4])
  np.testing.assert_allclose(no_warm, [1.0, 1.0, 0.5], atol=1e-6)


def test_unknown_schedule_is_an_error():
  with pytest.raises(ValueError, match="optimizer.schedule"):
    optimizer.make_schedule(_opt(schedule="step"), 10)


# ------------------------------------------------------------------------------------------
# Weight-decay mask.
# ------------------------------------------------------------------------------------------
def _params(variant):
  config = tiny_config(variant)
  model = build_model(config.model)
  tokens = jnp.zeros((1, config.model.context_length), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens))["params"]


def _decayed(params):
  flat = jax.tree_util.tree_leaves_with_path(optimizer.decay_mask(params))
  return {"/".join(k.key for k in path): bool(v) for path, v in flat}


@pytest.mark.parametrize("variant", ["preln", "sas", "sas_p_nonorm", "op", "value_skipinit"])
def test_decay_mask_on_real_model_trees(variant):
  mask = _decayed(_params(variant))
  for path, decayed in mask.items():
    leaf = path.split("/")[-1]
    assert decayed == (leaf in ("kernel", "embedding")), path
  # Embeddings and every dense kernel are decayed (docs/model.md, "Training settings") ...
  assert mask["wte/embedding"] and mask["wpe/embedding"]
  assert mask["h_0/mlp/c_fc/kernel"] and mask["h_0/attn/c_attn/kernel"]
  # ... norm parameters, biases and gains never are.
  assert not mask["ln_f/scale"] and not mask["ln_f/bias"] and not mask["h_0/attn/c_attn/bias"]


def test_decay_mask_spares_gains_and_norms_of_sas():
  mask = _decayed(_params("sas"))
  for path in ("h_0/attn/attn_mat_resid_gain", "h_0/attn/centre_attn_gain",
               "h_0/attn/value/resid_gain", "h_0/attn/value/skip_gain",
               "h_0/mlp_block_resid_gain", "h_0/norm1/scale"):
    assert mask[path] is False, path
  assert mask["h_0/attn/value/kernel"] is True     # the trainable, zero-initialised W of SAS


def test_decay_mask_rejects_unknown_leaf_names():
  with pytest.raises(ValueError, match="blk/w"):
    optimizer.decay_mask({"blk": {"w": jnp.zeros(3)}})


def test_adamw_decays_only_masked_leaves():
  config = ml_collections.ConfigDict(dict(num_train_steps=10, optimizer=_opt(
      schedule="constant", warmup_steps=0, learning_rate=0.5, weight_decay=0.1)))
  tx = optimizer.make_optimizer(config)
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "g_gain": jnp.ones(())}
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.5 * 0.1 * np.ones((2, 2)))
  np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)
  np.testing.assert_array_equal(updates["g_gain"], 0.0)


def test_gradients_are_clipped_to_the_global_norm():
  config = ml_collections.ConfigDict(dict(num_train_steps=10, optimizer=_opt(
      schedule="constant", warmup_steps=0, grad_clip_norm=1.0, weight_decay=0.0)))
  tx = optimizer.make_optimizer(config)
  params = {"kernel": jnp.zeros(4)}
  grads = {"kernel": jnp.array([30.0, 40.0, 0.0, 0.0])}      # norm 50
  _, state = tx.update(grads, tx.init(params), params)
  adam_state = state[1][0]
  np.testing.assert_allclose(adam_state.mu["kernel"], 0.1 * np.array([0.6, 0.8, 0, 0]),
                             rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Gradient accumulation.
# ------------------------------------------------------------------------------------------
def test_micro_batches_are_strided():
  batch = {"inputs": jnp.arange(8)[:, None] * jnp.ones((1, 3), jnp.int32)}
  parts = optimizer.micro_batches(batch, 2)["inputs"]
  assert parts.shape == (2, 4, 3)
  np.testing.assert_array_equal(parts[0, :, 0], [0, 2, 4, 6])
  np.testing.assert_array_equal(parts[1, :, 0], [1, 3, 5, 7])
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    optimizer.micro_batches(batch, 3)


def test_accumulated_gradient_sums_equal_the_whole_batch():
  w = jnp.array([0.5, -1.0, 2.0])

  def sum_grad_fn(params, batch, index):
    del index
    loss = lambda p: jnp.sum((batch["x"] @ p - batch["y"]) ** 2)
    return jax.grad(loss)(params), {"n": jnp.float32(batch["x"].shape[0])}

  rng = np.random.default_rng(0)
  batch = {"x": jnp.asarray(rng.normal(size=(12, 3)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(12,)), jnp.float32)}
  whole_grads, whole_sums = sum_grad_fn(w, batch, 0)
  for k in (2, 3, 4):
    grads, sums = jax.jit(optimizer.accumulate_gradients, static_argnums=(0, 3))(
        sum_grad_fn, w, batch, k)
    np.testing.assert_allclose(grads, whole_grads, rtol=1e-5)
    assert float(sums["n"]) == float(whole_sums["n"]) == 12


# ------------------------------------------------------------------------------------------
# The optimiser choice.
# ------------------------------------------------------------------------------------------
def _muon_config(**overrides):
  return ml_collections.ConfigDict(dict(num_train_steps=10, optimizer=_opt(
      name="muon", muon_beta=0.95, muon_rms=0.2, schedule="constant", warmup_steps=0,
      learning_rate=0.5, **overrides)))


MUON_PARAMS = {"dense": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones(16)},
               "wte": {"embedding": jnp.ones((5, 8))}, "g_gain": jnp.ones(())}


def test_muon_decays_the_same_leaves_as_adamw():
  tx = optimizer.make_optimizer(_muon_config(weight_decay=0.1, grad_clip_norm=0.0))
  zeros = jax.tree.map(jnp.zeros_like, MUON_PARAMS)
  updates, _ = tx.update(zeros, tx.init(MUON_PARAMS), MUON_PARAMS)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.5 * 0.1 * np.ones((8, 16)))
  np.testing.assert_allclose(updates["wte"]["embedding"], -0.5 * 0.1 * np.ones((5, 8)))
  np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)
  np.testing.assert_array_equal(updates["g_gain"], 0.0)


def test_muon_orthogonalises_kernels_and_leaves_the_rest_to_adam():
  tx = optimizer.make_optimizer(_muon_config(weight_decay=0.0, grad_clip_norm=0.0))
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 4))
  grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), MUON_PARAMS)
  updates, _ = tx.update(grads, tx.init(MUON_PARAMS), MUON_PARAMS)
  singular = np.linalg.svd(np.asarray(updates["dense"]["kernel"]), compute_uv=False)
  # Newton-Schulz orthogonalises approximately (Muon's quintic maps singular values into
  # about [0.7, 1.2]): bunched, unlike the gradient's.
  grad_singular = np.linalg.svd(np.asarray(grads["dense"]["kernel"]), compute_uv=False)
  assert singular.max() / singular.min() < 1.8 < 3 < grad_singular.max() / grad_singular.min()
  assert 0.1 < float(jnp.sqrt(jnp.mean(updates["dense"]["kernel"] ** 2))) / 0.5 < 0.25
  # Adam's first step is lr * sign(g) (up to eps) on every other leaf.
  np.testing.assert_allclose(updates["wte"]["embedding"],
                             -0.5 * np.sign(grads["wte"]["embedding"]), rtol=1e-4)
  assert optimizer.muon_matrix(("h_0", "mlp", "c_fc", "kernel"), jnp.zeros((2, 3, 4)))  # stacked
  assert not optimizer.muon_matrix(("wte", "embedding"), jnp.zeros((3, 4)))


def test_unknown_optimizer_is_a_config_error_naming_the_choices():
  from simplified_flax.runs import config_checks  # pylint: disable=import-outside-toplevel
  config = tiny_config("preln")
  config.optimizer.name = "sgd"
  with pytest.raises(config_checks.ConfigError,
                     match=r"optimizer.name='sgd' is unknown: use one of \['adamw', 'muon'\]"):
    config_checks.validate_run_config(config)
  with pytest.raises(ValueError, match="optimizer.name='sgd' is unknown"):
    optimizer.make_optimizer(config)
  del config.optimizer.name   # configs saved before the field existed get AdamW
  adamw = tiny_config("preln")
  adamw.optimizer.name = "adamw"
  params = {"h": {"kernel": jnp.zeros((2, 2))}}
  assert (jax.tree.structure(optimizer.make_optimizer(config).init(params))
          == jax.tree.structure(optimizer.make_optimizer(adamw).init(params)))

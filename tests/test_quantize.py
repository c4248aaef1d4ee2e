"""Fake int8 quantisation (model/quantize.py): the quantiser's guarantees, an outlier that a
per-tensor activation grid cannot absorb, and the scheme reaching every linear layer once."""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax.model import quantize
from simplified_flax.model.transformer import build_model


def test_high_bit_width_is_the_identity_within_round_off():
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 48)) * 3.0
  for axis in (None, -1, 0):
    np.testing.assert_allclose(quantize.fake_quantize(x, bits=24, channel_axis=axis), x,
                               rtol=0, atol=3e-6 * float(jnp.max(jnp.abs(x))))


@pytest.mark.parametrize("axis", [None, -1])
def test_error_is_at_most_half_a_step_and_the_maximum_is_exact(axis):
  x = jax.random.normal(jax.random.PRNGKey(1), (256, 32)) * jnp.linspace(0.1, 10.0, 32)
  q = quantize.fake_quantize(x, bits=8, channel_axis=axis)
  amax = jnp.max(jnp.abs(x)) if axis is None else jnp.max(jnp.abs(x), axis=0, keepdims=True)
  step = amax / 127
  assert bool(jnp.all(jnp.abs(q - x) <= step / 2 * (1 + 1e-5)))
  assert float(jnp.max(jnp.abs(q - x))) > 0.3 * float(jnp.min(step))    # it does round
  assert len(np.unique(np.asarray(q[:, 3]))) <= 255                      # an int8 grid
  # The largest entry (of the tensor, or of each output channel) is on the grid exactly.
  np.testing.assert_allclose(jnp.max(jnp.abs(q), axis=0 if axis else None), amax.squeeze(),
                             rtol=1e-6)
  assert bool(jnp.all(quantize.fake_quantize(jnp.zeros((3, 4)), channel_axis=axis) == 0))


def test_one_outlier_neuron_ruins_per_tensor_activation_quantisation():
  """A neuron 100x the others' scale sets the per-tensor grid: the other neurons fall to a
  handful of levels, so a layer's output error grows far beyond its error without it."""
  key_x, key_w = jax.random.split(jax.random.PRNGKey(2))
  x_ND = jax.random.normal(key_x, (512, 64))
  w_DF = jax.random.normal(key_w, (64, 64)) / 8
  with_outlier_ND = x_ND.at[:, 5].multiply(100.0)

  def relative_error(inputs):
    """Error of the output the 63 ordinary neurons carry, relative to that output."""
    others = jnp.delete(jnp.arange(64), 5)
    exact = inputs[:, others] @ w_DF[others]
    quantised = quantize.fake_quantize(inputs)[:, others] @ w_DF[others]
    return float(jnp.linalg.norm(quantised - exact) / jnp.linalg.norm(exact))

  clean, hurt = relative_error(x_ND), relative_error(with_outlier_ND)
  assert clean < 0.01 and hurt > 20 * clean, (clean, hurt)


def test_unknown_scheme_names_the_choices():
  with pytest.raises(ValueError, match=r"--quantize='w4' is unknown: use one of \['none', "):
    quantize.parse_scheme("w4")
  assert quantize.parse_scheme(None) == (False, False)
  assert quantize.parse_scheme("w8a8") == (True, True)


def _quantised_weights(variant):
  """(shapes of the matrices the "w8" scheme quantised, the model, variables, tokens)."""
  config = tiny_config(variant)
  model = build_model(config.model)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, 61)
  variables = model.init(jax.random.PRNGKey(4), tokens)
  seen = []

  def spy(x, bits=8, channel_axis=None):
    seen.append(x.shape)
    return fake_quantize(x, bits, channel_axis)

  fake_quantize = quantize.fake_quantize
  with mock.patch.object(quantize, "fake_quantize", spy), quantize.applied("w8"):
    model.apply(variables, tokens)
  return seen, model, variables, tokens


@pytest.mark.parametrize("variant", ["preln", "op", "sas_p"])
def test_every_linear_layer_is_reached_once(variant):
  seen, _, variables, _ = _quantised_weights(variant)
  # Every matrix of the parameter tree (a reparameterised Value/Proj's own kernel included)
  # and the tied head [D, V]; an identity Value/Proj has no matrix and is rightly not reached.
  kernels = [x.shape for path, x in jax.tree_util.tree_leaves_with_path(variables["params"])
             if path[-1].key == "kernel"]
  embedding_VD = variables["params"]["wte"]["embedding"]
  assert sorted(seen) == sorted(kernels + [embedding_VD.T.shape])


def test_schemes_change_the_logits_only_when_asked():
  _, model, variables, tokens = _quantised_weights("op")
  full = jax.jit(model.apply)(variables, tokens)
  run = lambda scheme, bits=8: jax.jit(quantize.quantized(model.apply, scheme, bits))(
      variables, tokens)
  np.testing.assert_array_equal(run("none"), full)
  np.testing.assert_allclose(run("w8a8", bits=24), full, atol=1e-5)
  errors = {s: float(jnp.max(jnp.abs(run(s) - full))) for s in ("w8", "a8", "w8a8")}
  assert all(0 < e < 0.1 for e in errors.values()), errors

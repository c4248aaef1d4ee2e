"""The linear layers keep plain nn.Dense's values and gradients: the reference's
(`model/layers.py`) and the speed package's, whose gradients are hand-written under the rules of
`fast.grad_rules` (`fast/layers.py`, under a plan with every rule)."""
import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.fast import grad_rules
from simplified_flax.fast import layers as fast_layers
from simplified_flax.fast.plan import Plan
from simplified_flax.model import layers

EVERY_RULE = Plan("cpu", frozenset(grad_rules.AUTO_PLATFORM), "explicit")   # "on" on a CPU


def _dense(plan, features, dtype, name, **kwargs):
  """The reference's linear layer (`plan` None), else the speed package's under `plan`."""
  if plan is None:
    return layers.dense(features, dtype, name, **kwargs)
  return fast_layers.dense(plan, features, dtype, name, **kwargs)


@pytest.mark.parametrize("plan", [None, EVERY_RULE], ids=["reference", "every_rule"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_matches_nn_dense_params_values_and_gradients(use_bias, plan):
  x_BTD = jax.random.normal(jax.random.key(0), (2, 5, 8))
  ours = _dense(plan, 12, jnp.float32, "ours", use_bias=use_bias)
  theirs = nn.Dense(12, use_bias=use_bias, kernel_init=layers.normal_init(layers.PLAIN_STD))
  params = ours.init(jax.random.key(1), x_BTD)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(
      jnp.shape, theirs.init(jax.random.key(1), x_BTD))
  params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape), params)

  def loss(module):
    return lambda p, x: jnp.sum(jnp.tanh(module.apply(p, x)) ** 2)

  np.testing.assert_allclose(ours.apply(params, x_BTD), theirs.apply(params, x_BTD), rtol=1e-6)
  got = jax.grad(loss(ours), argnums=(0, 1))(params, x_BTD)
  want = jax.grad(loss(theirs), argnums=(0, 1))(params, x_BTD)
  for g_got, g_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)
  # Only one side differentiated: the other tangent is a symbolic zero the rule skips.
  for argnum in (0, 1):
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(jax.grad(loss(ours), argnums=argnum)(params, x_BTD))[0],
        jax.flatten_util.ravel_pytree(jax.grad(loss(theirs), argnums=argnum)(params, x_BTD))[0],
        rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan", [None, EVERY_RULE], ids=["reference", "every_rule"])
def test_linear_in_bfloat16_keeps_float32_kernel_gradients(plan):
  x_BTD = jax.random.normal(jax.random.key(0), (2, 5, 8))
  module = _dense(plan, 4, jnp.bfloat16, "ours")
  params = module.init(jax.random.key(1), x_BTD)
  assert module.apply(params, x_BTD).dtype == jnp.bfloat16
  grads = jax.grad(lambda p: jnp.sum(module.apply(p, x_BTD).astype(jnp.float32)))(params)
  assert grads["params"]["kernel"].dtype == jnp.float32
  np.testing.assert_allclose(grads["params"]["kernel"],
                             jnp.broadcast_to(x_BTD.sum((0, 1))[:, None], (8, 4)), rtol=2e-2)

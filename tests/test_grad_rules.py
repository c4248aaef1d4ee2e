"""The speed-only gradient rules (simplified_flax/fast/grad_rules.py), each against autodiff of
the formula it replaces. Whole models under every platform's plan: tests/test_fast_matrix.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax import fast
from simplified_flax.fast import grad_rules
from simplified_flax.fast import layers as fast_layers
from simplified_flax.model import attention
from simplified_flax.model import layers
from simplified_flax.runs import config_checks


def test_a_bad_mode_is_refused_naming_the_field_and_a_mode_leaves_out_what_it_names():
  with pytest.raises(config_checks.ConfigError, match=r"model.grad_rules='fast' is unknown"):
    config_checks.validate_model_config(tiny_config("preln", grad_rules="fast").model)
  for bad in ("auto,-fast", "auto,relu", "off,-relu"):
    with pytest.raises(config_checks.ConfigError, match=r"',-RULE' after 'auto' or 'on'"):
      config_checks.validate_model_config(tiny_config("preln", grad_rules=bad).model)
  config = tiny_config("preln", grad_rules="auto,-relu_matmul, -split")
  config_checks.validate_model_config(config.model)
  plan = fast.choose(config.model, dtype=jnp.bfloat16, platform="gpu")
  assert plan.applies("relu") and plan.applies("combine")
  assert not plan.applies("relu_matmul") and not plan.applies("split")
  plan = fast.choose(tiny_config("preln", grad_rules="on,-dense").model, dtype=jnp.float32,
                     platform="cpu")
  assert not plan.applies("dense") and plan.applies("out_gain")


def test_the_gain_rule_takes_any_number_of_terms():
  """A new shaping term (a per-head gain times a fixed matrix) needs no change here."""
  keys = jax.random.split(jax.random.key(0), 5)
  logits_BHQK = jax.random.normal(keys[0], (2, 3, 4, 4))
  gains = [jax.random.normal(k, (3,)) for k in keys[1:4]]
  matrices = [jnp.eye(4), jnp.tril(jnp.ones((4, 4))) / 4, jax.random.normal(keys[4], (4, 4))]
  rule = grad_rules.fast_gain_gradients(attention.shape_attention_matrix)

  def loss(shape, logits_BHQK, resid_H, gains):
    shaped_BHQK, probs_BHQK = shape(logits_BHQK, resid_H, list(zip(gains, matrices)))
    return jnp.sum(jnp.sin(shaped_BHQK)) + jnp.sum(jnp.cos(probs_BHQK))

  args = (logits_BHQK, jnp.ones(3), gains)
  got = jax.grad(functools.partial(loss, rule), argnums=(0, 1, 2))(*args)
  want = jax.grad(functools.partial(loss, attention.shape_attention_matrix), argnums=(0, 1, 2))(
      *args)
  for g_got, g_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_relu_rule_is_leaky_relu_bit_for_bit_with_derivative_1_at_0(dtype):
  """As the authors' `torch.where(x >= 0, x, slope * x)`: at x = 0 the gradient passes."""
  x = jnp.concatenate([jax.random.normal(jax.random.key(0), (64,)), jnp.array([0.0, -0.0])])
  x, cotangent = x.astype(dtype), jnp.linspace(-2, 2, x.size).astype(dtype)
  plain_y, plain_vjp = jax.vjp(lambda x: jax.nn.leaky_relu(x, 0.0), x)
  assert "custom_jvp_call" in str(jax.make_jaxpr(grad_rules.leaky_relu, static_argnums=1)(x, 0.0))
  rule_y, rule_vjp = jax.vjp(lambda x: grad_rules.leaky_relu(x, 0.0), x)
  np.testing.assert_array_equal(rule_y, plain_y)
  np.testing.assert_array_equal(rule_vjp(cotangent)[0], plain_vjp(cotangent)[0])
  np.testing.assert_array_equal(rule_vjp(cotangent)[0][-2:], cotangent[-2:])


def test_a_nonzero_slope_keeps_leaky_relu():
  jaxpr = str(jax.make_jaxpr(lambda x: grad_rules.leaky_relu(x, 0.1))(jnp.ones(3)))
  assert "custom_jvp_call" not in jaxpr


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_the_split_rule_gives_q_and_k_as_one_gemm_and_its_bias_add_does(dtype, tolerance,
                                                                         separate):
  """c_attn's halves, `split(x @ W + b)`: values and the gradients of x, W and b as the one
  GEMM and its bias add; `separate`, from two GEMMs that hold their own operands (round-off),
  else from the one GEMM with the split's tangent held once (bit for bit)."""
  N, D = 6, 12   # D + 1 not a multiple of 8: the ones column is padded
  x_ND, kernel_DF, bias_F = (jax.random.normal(jax.random.key(i), shape).astype(dtype)
                             for i, shape in enumerate([(N, D), (D, 2 * D), (2 * D,)]))
  weights_ND = jnp.linspace(-1, 1, N * D).reshape(N, D).astype(dtype)

  halves = {"on": functools.partial(grad_rules.biased_halves, separate=separate),
            "off": lambda x, kernel, bias: tuple(jnp.split(jnp.dot(x, kernel) + bias, 2, -1))}
  results, jaxprs = {}, {}
  for mode, split in halves.items():
    def loss(x_ND, kernel_DF, bias_F, split=split):
      q_ND, k_ND = split(x_ND, kernel_DF, bias_F)
      return jnp.sum((q_ND * weights_ND).astype(jnp.float32)) - jnp.sum(
          (k_ND.astype(jnp.float32) ** 2))
    results[mode] = (split(x_ND, kernel_DF, bias_F),
                     jax.grad(loss, argnums=(0, 1, 2))(x_ND, kernel_DF, bias_F))
    jaxprs[mode] = (str(jax.make_jaxpr(loss)(x_ND, kernel_DF, bias_F)),
                    str(jax.make_jaxpr(jax.grad(loss))(x_ND, kernel_DF, bias_F)))
  gemms, barriers = (2, 4) if separate else (1, 1)   # with the barriers' transposes
  assert jaxprs["on"][0].count("dot_general") == gemms and jaxprs["off"][0].count(
      "dot_general") == 1
  assert jaxprs["on"][1].count("optimization_barrier") == barriers
  assert "optimization_barrier" not in jaxprs["off"][1]
  for got, want in zip(jax.tree.leaves(results["on"]), jax.tree.leaves(results["off"])):
    assert got.shape == want.shape and got.dtype == want.dtype
    if not separate:
      np.testing.assert_array_equal(got, want)
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                               atol=tolerance * scale, rtol=0)
  # A bias that entered the GEMMs wrongly (e.g. the ones column on the wrong side) shows.
  q_ND, _ = grad_rules.biased_halves(x_ND, kernel_DF, 2 * bias_F, separate=separate)
  assert not np.allclose(q_ND.astype(jnp.float32), results["off"][0][0].astype(jnp.float32),
                         atol=tolerance * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_norm_stats_rule_gives_the_plain_norms_value_and_gradients(dtype):
  """The fast RMSNorm given x's sums of squares: `layers.rms_norm`'s value and gradients, the
  sums' part of the gradient in x's (their own cotangent zero)."""
  keys = jax.random.split(jax.random.key(0), 3)
  x_BTD = (3.0 * jax.random.normal(keys[0], (2, 5, 8))).astype(dtype)
  scale_D = 1.0 + jax.random.normal(keys[1], (8,))
  weights_BTD = jax.random.normal(keys[2], (2, 5, 8))
  sums_BT = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), axis=-1)
  given = lambda x, scale, sums: fast_layers._rms_norm_given_sums(  # pylint: disable=protected-access
      x, scale, sums, 1e-5, dtype)
  loss = lambda x, scale, sums: jnp.sum(given(x, scale, sums).astype(jnp.float32) * weights_BTD)
  plain_loss = lambda x, scale: jnp.sum(
      layers.rms_norm(x, scale, 1e-5, dtype).astype(jnp.float32) * weights_BTD)
  one_rounding = 1e-6 if dtype == jnp.float32 else 2.0 ** -7
  np.testing.assert_allclose(
      np.float32(given(x_BTD, scale_D, sums_BT)),
      np.float32(layers.rms_norm(x_BTD, scale_D, 1e-5, dtype)), rtol=one_rounding, atol=1e-6)
  dx, dscale, dsums = jax.grad(loss, argnums=(0, 1, 2))(x_BTD, scale_D, sums_BT)
  want_dx, want_dscale = jax.grad(plain_loss, argnums=(0, 1))(x_BTD, scale_D)
  np.testing.assert_allclose(np.float32(dx), np.float32(want_dx), rtol=one_rounding, atol=1e-6)
  np.testing.assert_allclose(dscale, want_dscale, rtol=one_rounding, atol=1e-6)
  np.testing.assert_array_equal(dsums, 0.0)
  # Autodiff of the forward, the sums held as given, would miss their part of x's gradient.
  as_given = lambda x: jnp.sum((scale_D * x.astype(jnp.float32) / (
      jnp.sqrt(sums_BT[..., None] / 8) + 1e-5)).astype(dtype).astype(jnp.float32) * weights_BTD)
  assert not np.allclose(np.float32(jax.grad(as_given)(x_BTD)), np.float32(want_dx), atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_skip_rule_gives_the_products_value_gradients_and_tangents(dtype):
  """`gain * x` and its derivatives, the gain's gradient summed over B and T before D (an
  optimization barrier between the two, so that XLA keeps them apart)."""
  keys = jax.random.split(jax.random.key(0), 2)
  x_BTD = jax.random.normal(keys[0], (2, 5, 8)).astype(dtype)
  weights_BTD = jax.random.normal(keys[1], (2, 5, 8))
  gain = jnp.float32(0.7)
  loss = lambda scale: lambda gain, x: jnp.sum(jnp.sin(scale(gain, x)) * weights_BTD)
  plain = lambda gain, x: gain * x
  held_value = grad_rules.scaled_skip(gain, x_BTD)
  held_grads = jax.grad(loss(grad_rules.scaled_skip), argnums=(0, 1))(gain, x_BTD)
  held_tangent = jax.jvp(grad_rules.scaled_skip, (gain, x_BTD), (jnp.float32(0.3), x_BTD))[1]
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(loss(grad_rules.scaled_skip)))(gain, x_BTD))
  np.testing.assert_array_equal(held_value, plain(gain, x_BTD))
  want_grads = jax.grad(loss(plain), argnums=(0, 1))(gain, x_BTD)
  np.testing.assert_allclose(held_grads[0], want_grads[0], rtol=1e-5)
  np.testing.assert_array_equal(held_grads[1], want_grads[1])
  np.testing.assert_allclose(
      held_tangent, jax.jvp(plain, (gain, x_BTD), (jnp.float32(0.3), x_BTD))[1], rtol=1e-6)
  assert grad_jaxpr.count("optimization_barrier") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_out_gain_rule_gives_the_products_gradients_without_keeping_its_output(dtype):
  """`gain * (x @ W)`: the same value, autodiff's gradients (round-off: the gain's is summed
  as sum(x * (g W^T)), not sum(g * (x W))), and a backward that keeps the input and the
  kernel but not the [N, D] output, the traffic the rule exists to save."""
  keys = jax.random.split(jax.random.key(0), 3)
  x_NF = jax.random.normal(keys[0], (6, 12)).astype(dtype)
  kernel_FD = (jax.random.normal(keys[1], (12, 5)) / 4).astype(dtype)
  weights_ND = jax.random.normal(keys[2], (6, 5))
  gain = jnp.float32(0.7)
  plain = lambda gain, x, kernel: gain * jnp.dot(x, kernel)
  loss = lambda product: lambda *args: jnp.sum(jnp.sin(product(*args)) * weights_ND)
  rule_value = grad_rules.gained_matmul(gain, x_NF, kernel_FD)
  rule_grads = jax.grad(loss(grad_rules.gained_matmul), argnums=(0, 1, 2))(gain, x_NF, kernel_FD)
  _, rule_backward = jax.vjp(grad_rules.gained_matmul, gain, x_NF, kernel_FD)
  np.testing.assert_array_equal(rule_value, plain(gain, x_NF, kernel_FD))
  want_grads = jax.grad(loss(plain), argnums=(0, 1, 2))(gain, x_NF, kernel_FD)
  tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == jnp.float32 else {"rtol": 2e-2,
                                                                         "atol": 2e-2}
  for got, want in zip(rule_grads, want_grads):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **tolerance)
  kept_shapes = {leaf.shape for leaf in jax.tree.leaves(rule_backward)}
  _, plain_backward = jax.vjp(plain, gain, x_NF, kernel_FD)
  assert (6, 5) in {leaf.shape for leaf in jax.tree.leaves(plain_backward)}   # autodiff keeps it
  assert (6, 5) not in kept_shapes and {(6, 12), (12, 5)} <= kept_shapes

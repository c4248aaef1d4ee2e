"""Rotary position embeddings (model/rope.py, `model.position_embedding="rope"`): RoFormer's
rotation by hand, q . k a function of the position difference only, and a rotary Pre-LN whose
packed rows, cached decoding and parameter tree are what positions in attention imply."""
import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from simplified_flax.model import decode
from simplified_flax.model import rope
from simplified_flax.model import transformer

V = 61
apply_cached = jax.jit(decode.apply_cached, static_argnums=0)


def test_rotate_is_roformers_rotation_of_adjacent_pairs():
  x_BTHd = np.random.default_rng(0).standard_normal((2, 5, 3, 8)).astype(np.float32)
  positions_BT = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 9, 2]])
  d, theta = 8, 500.0
  expected = np.empty_like(x_BTHd)
  for i in range(d // 2):
    angle_BT1 = (positions_BT * theta ** (-2 * i / d))[..., None]
    a, b = x_BTHd[..., 2 * i], x_BTHd[..., 2 * i + 1]
    expected[..., 2 * i] = a * np.cos(angle_BT1) - b * np.sin(angle_BT1)
    expected[..., 2 * i + 1] = a * np.sin(angle_BT1) + b * np.cos(angle_BT1)
  np.testing.assert_allclose(rope.rotate(x_BTHd, positions_BT, theta), expected, atol=1e-6)


def test_rotated_dot_products_depend_on_the_position_difference_only():
  q_1T1d, k_1T1d = (np.random.default_rng(s).standard_normal((1, 1, 1, 16)).astype(np.float32)
                    for s in (1, 2))
  def dot(pq, pk):
    q = rope.rotate(q_1T1d, jnp.array([[pq]]))
    k = rope.rotate(k_1T1d, jnp.array([[pk]]))
    return float(jnp.sum(q * k))
  assert abs(dot(5, 2) - dot(105, 102)) < 1e-4 and abs(dot(5, 2) - dot(3, 0)) < 1e-4
  assert abs(dot(5, 2) - dot(2, 5)) > 1e-3   # the sign of the difference matters
  assert abs(dot(0, 0) - float(np.sum(q_1T1d * k_1T1d))) < 1e-5


def test_a_rotary_model_has_no_position_table_packs_and_decodes_as_positions_say():
  """Pre-LN with rotary positions: no `wpe`; a packed row equals its documents alone (positions
  restart in each segment); cached decoding equals the full pass (positions go on from the
  cache), in both attention forms."""
  tokens_1T = np.random.default_rng(3).integers(3, V, (1, 12)).astype(np.int32)
  models = {impl: transformer.build_model(tiny_config(
      "preln", attention_impl=impl, position_embedding="rope", rope_theta=100.0).model)
            for impl in ("explicit", "fused")}
  variables = jax.jit(models["fused"].init)(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))
  assert "wpe" not in variables["params"]
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, np.float32),
                           variables)

  @jax.jit
  def full(variables):
    out = {}
    for impl, model in models.items():
      out[impl] = model.apply(variables, tokens_1T)
      out[f"{impl}_packed"] = model.apply(variables, tokens_1T,
                                          segment_ids=jnp.array([[1] * 5 + [2] * 7]))
      out[f"{impl}_second"] = model.apply(variables, tokens_1T[:, 5:])
    return out
  out = full(variables)
  for impl, model in models.items():
    np.testing.assert_allclose(out[f"{impl}_packed"][:, :5], out[impl][:, :5], atol=1e-5)
    np.testing.assert_allclose(out[f"{impl}_packed"][:, 5:], out[f"{impl}_second"], atol=1e-5)
    cache = decode.init_cache(model, 1, 12)
    prefill_1TV, cache = apply_cached(model, variables, cache, tokens_1T[:, :4])
    steps = [prefill_1TV]
    for t in range(4, 12):
      logits_11V, cache = apply_cached(model, variables, cache, tokens_1T[:, t:t + 1])
      steps.append(logits_11V)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), out[impl], atol=1e-5, rtol=1e-5,
                               err_msg=impl)
  np.testing.assert_allclose(out["explicit"], out["fused"], atol=1e-5)

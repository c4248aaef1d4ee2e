"""Signal-propagation diagnostics on cases with a known answer, and `collect` on a real model."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax.model import attention
from simplified_flax.training import diagnostics
from simplified_flax.model import transformer


def hadamard(k: int) -> np.ndarray:
  """Sylvester Hadamard matrix [k, k] of +-1 with orthogonal rows and columns (k a power of 2)."""
  h = np.ones((1, 1))
  while h.shape[0] < k:
    h = np.block([[h, h], [h, -h]])
  return h


def paired_features(signs_NK: np.ndarray, scales_K) -> jnp.ndarray:
  """x [1, N, 2K]: feature pair p is (c_p s_np, -c_p s_np), so every token already has mean 0."""
  pair_NK = signs_NK * np.asarray(scales_K)[None, :]
  x_NK2 = np.stack([pair_NK, -pair_NK], axis=-1)
  return jnp.asarray(x_NK2.reshape(1, signs_NK.shape[0], -1), jnp.float32)


def planted_kurtosis(a: float, k: int) -> float:
  """var_D(s) when one of k feature pairs has scale a and the rest scale 1 (derived by hand).

  r^2 = (a^2 + k - 1) / k,  s = c^2 / r^2,  mean(s^2) = k (a^4 + k - 1) / (a^2 + k - 1)^2.
  """
  return k * (a**4 + k - 1) / (a**2 + k - 1) ** 2 - 1


def kurtosis(x):
  return diagnostics.hidden_state_metrics(x)["kurtosis"]


# ----------------------------------------------------------------------------- kurtosis

@pytest.mark.parametrize("a", [1.0, 3.0, 20.0])
def test_kurtosis_of_planted_outlier_feature_matches_closed_form(a):
  k = 8
  x = paired_features(hadamard(k), [a] + [1.0] * (k - 1))
  np.testing.assert_allclose(kurtosis(x), planted_kurtosis(a, k), rtol=1e-5,
                             atol=1e-6)


def test_kurtosis_ignores_per_token_offsets_and_scale():
  k = 8
  x = paired_features(hadamard(k), [5.0] + [1.0] * (k - 1))
  offsets = jnp.arange(k, dtype=jnp.float32)[None, :, None] * 7.0
  np.testing.assert_allclose(kurtosis(3.0 * x + offsets), kurtosis(x),
                             rtol=1e-5)


def test_kurtosis_grows_with_the_outlier():
  k = 8
  values = [float(kurtosis(paired_features(hadamard(k), [a] + [1.0] * (k - 1))))
            for a in (1.0, 2.0, 4.0, 8.0)]
  assert values[0] == pytest.approx(0.0, abs=1e-6)
  assert all(b > a for a, b in zip(values, values[1:]))


# ------------------------------------------------------------------------- correlations

def test_feature_correlation_of_orthogonal_pairs():
  # z^T z / N is the identity except the -1 that ties each feature to its pair partner.
  k = 8
  x = paired_features(hadamard(k), [1.0] * k)
  D = 2 * k
  np.testing.assert_allclose(diagnostics.hidden_state_metrics(x)["feature_corr_rms"],
                             math.sqrt(1 / (D - 1)), rtol=1e-5)


def test_token_correlation_orthogonal_tokens_are_zero():
  result = diagnostics.hidden_state_metrics(paired_features(hadamard(8), [1.0] * 8))
  np.testing.assert_allclose(result["token_corr_mean"], 0.0, atol=1e-6)
  np.testing.assert_allclose(result["token_corr_rms"], 0.0, atol=1e-3)   # sqrt of round-off


def test_token_correlation_identical_tokens_are_one():
  result = diagnostics.hidden_state_metrics(paired_features(np.ones((6, 4)), [1.0, 2.0, 3.0, 4.0]))
  np.testing.assert_allclose(result["token_corr_mean"], 1.0, rtol=1e-5)
  np.testing.assert_allclose(result["token_corr_rms"], 1.0, rtol=1e-5)


def test_token_correlation_matches_the_explicit_gram_matrix():
  x = jax.random.normal(jax.random.key(0), (2, 5, 12)) + 0.5
  z = np.asarray(diagnostics.normalised_features(x)[0], np.float64)
  G = z @ z.T / z.shape[1]
  off = G[~np.eye(G.shape[0], dtype=bool)]
  result = diagnostics.hidden_state_metrics(x)
  np.testing.assert_allclose(result["token_corr_mean"], off.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(result["token_corr_rms"], np.sqrt(np.mean(off**2)), rtol=1e-4)


def test_max_median_ratio_of_one_spike_per_token():
  x = jnp.ones((2, 3, 9)).at[:, :, 4].set(-10.0)
  metrics = diagnostics.hidden_state_metrics(x)
  np.testing.assert_allclose(metrics["max_median_ratio"], 10.0, rtol=1e-6)
  np.testing.assert_allclose(metrics["hidden_rms"], np.std(np.asarray(x)[0, 0]), rtol=1e-6)


# ---------------------------------------------------------------------------- attention

def test_entropy_of_uniform_causal_rows_is_log_of_visible_keys():
  T = 16
  probs_BHTT = jnp.broadcast_to(attention.centering_matrix(T, T, causal=True)[0], (2, 3, T, T))
  expected = np.mean(np.log(np.arange(1, T + 1)))
  np.testing.assert_allclose(diagnostics.attention_entropy(probs_BHTT), expected, rtol=1e-6)
  for i in (0, 5, T - 1):   # row by row: log(i + 1)
    np.testing.assert_allclose(diagnostics.attention_entropy(probs_BHTT[:, :, i:i + 1]),
                               math.log(i + 1), rtol=1e-6, atol=1e-7)


def test_entropy_of_one_hot_rows_is_zero():
  probs = jnp.broadcast_to(jnp.eye(8), (1, 2, 8, 8))
  assert float(diagnostics.attention_entropy(probs)) == 0.0


# -------------------------------------------------------------------------------- gains

def test_gain_metrics_names_and_values():
  params = {"h_2": {"attn": {"attn_mat_skip_gain": jnp.array([1.0, 2.0, 3.0]),
                             "value": {"resid_gain": jnp.array(0.5), "kernel": jnp.ones((2, 2))}},
                    "mlp_block_resid_gain": jnp.array(0.1)}}
  metrics = diagnostics.gain_metrics(params)
  assert set(metrics) == {"gain/h_2/attn_mat_skip_gain_mean", "gain/h_2/attn_mat_skip_gain_std",
                          "gain/h_2/value_resid_gain", "gain/h_2/mlp_block_resid_gain"}
  np.testing.assert_allclose(metrics["gain/h_2/attn_mat_skip_gain_mean"], 2.0)
  np.testing.assert_allclose(metrics["gain/h_2/attn_mat_skip_gain_std"], math.sqrt(2 / 3),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["gain/h_2/value_resid_gain"], 0.5)


# ------------------------------------------------------------------------------ collect

def sas_intermediates(impl="explicit"):
  config = tiny_config("sas", attention_impl=impl)
  model = transformer.build_model(config.model)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)
  variables = model.init(jax.random.key(0), tokens)
  _, state = model.apply(variables, tokens, mutable=["intermediates"])
  return config, state["intermediates"], variables["params"]


def test_collect_on_sas_at_init_has_uniform_attention_and_unit_skip_gains():
  # SAS initialises W_q = 0, so every softmax row is the uniform causal row: entropy log(i+1).
  config, intermediates, params = sas_intermediates()
  metrics = jax.jit(diagnostics.collect)(intermediates, params)
  T = config.model.context_length
  for layer in range(config.model.n_layer):
    np.testing.assert_allclose(metrics[f"attn_entropy/layer_{layer}"],
                               np.mean(np.log(np.arange(1, T + 1))), rtol=1e-5)
    for name in ("kurtosis", "feature_corr_rms", "token_corr_mean", "token_corr_rms",
                 "max_median_ratio", "hidden_rms"):
      assert np.isfinite(metrics[f"{name}/layer_{layer}"])
    assert float(metrics[f"gain/h_{layer}/attn_mat_skip_gain_mean"]) == 1.0
    assert float(metrics[f"gain/h_{layer}/attn_mat_skip_gain_std"]) == 0.0
  np.testing.assert_allclose(metrics["gain/h_0/mlp_block_resid_gain"], 0.1, rtol=1e-6)
  assert all(v.shape == () and v.dtype == jnp.float32 for v in metrics.values())


def test_collect_on_fused_attention_skips_only_the_entropy():
  _, intermediates, params = sas_intermediates("fused")
  metrics = diagnostics.collect(intermediates, params)
  assert not any(name.startswith("attn_entropy/") for name in metrics)
  assert "kurtosis/layer_1" in metrics


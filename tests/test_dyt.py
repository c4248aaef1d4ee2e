"""DyT (norm_type="dyt"): the formula of Zhu et al. (2025), where it sits in the model, how the
optimiser and diagnostics treat its alpha, and that the speed package leaves it to the reference."""
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from simplified_flax import fast
import simplified_flax.fast.plan  # pylint: disable=unused-import
from simplified_flax.model import layers
from simplified_flax.model import transformer
from simplified_flax.training import diagnostics
from simplified_flax.training import optimizer


def test_dyt_is_gamma_tanh_alpha_x_plus_beta_with_alpha_from_one_half():
  x_BTD = jax.random.normal(jax.random.key(0), (2, 3, 8)) * 3
  norm = layers.DyT()
  variables = norm.init(jax.random.key(1), x_BTD)
  assert float(variables["params"]["alpha_gain"]) == 0.5
  np.testing.assert_array_equal(variables["params"]["scale"], np.ones(8))
  np.testing.assert_array_equal(variables["params"]["bias"], np.zeros(8))
  alpha, gamma_D, beta_D = 1.7, jnp.linspace(-1, 2, 8), jnp.linspace(0.5, -0.5, 8)
  params = {"alpha_gain": jnp.float32(alpha), "scale": gamma_D, "bias": beta_D}
  out = norm.apply({"params": params}, x_BTD)
  np.testing.assert_allclose(out, gamma_D * np.tanh(alpha * np.asarray(x_BTD)) + beta_D,
                             rtol=1e-6, atol=1e-6)
  # Elementwise: no statistic over D (a norm's defining trait, which DyT drops).
  np.testing.assert_allclose(norm.apply({"params": params}, x_BTD[..., :1] * jnp.ones(8))[..., 0],
                             out[..., 0], rtol=1e-6)


def test_every_norm_of_a_dyt_model_is_dyt_and_its_alphas_are_logged_gains_never_decayed():
  config = tiny_config("sas_p_dyt")
  tokens_BT = jnp.zeros((1, 8), jnp.int32)
  params = transformer.build_model(config.model).init(jax.random.key(0), tokens_BT)["params"]
  flat = traverse_util.flatten_dict(params, sep="/")
  alphas = sorted(k for k in flat if k.endswith("alpha_gain"))
  # Each layer's norm1 and norm2 (norm2 unread in the parallel block, as its RMSNorm), ln_f.
  assert alphas == ["h_0/norm1/alpha_gain", "h_0/norm2/alpha_gain", "h_1/norm1/alpha_gain",
                    "h_1/norm2/alpha_gain", "ln_f/alpha_gain"]
  mask = traverse_util.flatten_dict(optimizer.decay_mask(params), sep="/")
  assert not any(mask[k] for k in alphas)
  metrics = diagnostics.gain_metrics(params)
  assert {"gain/h_0/norm1_alpha_gain", "gain/h_0/norm2_alpha_gain"} <= set(metrics)


def test_the_speed_package_leaves_dyt_to_the_reference_and_says_so(caplog):
  # The norm alone (the config's recipe also scales the embedding, which the line would name).
  config = tiny_config("preln_dyt", embedding_scale="none")
  fast.plan.forget_logged_lines()   # each line is logged once a process; this test reads it
  with caplog.at_level("WARNING"):
    model = fast.build_model(config.model, platform="cpu")
  assert type(model) is transformer.Transformer
  assert "model.norm_type='dyt' was not verified" in caplog.text


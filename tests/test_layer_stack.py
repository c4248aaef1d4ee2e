"""`model.scan_layers` / `model.remat` / `model.scan_residuals`: which layers one scan runs, and that the scanned model
(weights converted with `scan_layout.stack_layers`) gives the unrolled model's losses,
gradients, diagnostics and cached decoding."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from simplified_flax.model import decode
from simplified_flax.model import layer_stack
from simplified_flax.model import scan_layout
from simplified_flax.model import transformer
from simplified_flax.runs import compatibility
from simplified_flax.training import diagnostics

L = 4
TOKENS_BT = jax.random.randint(jax.random.key(1), (2, 16), 0, 61)


@pytest.mark.parametrize("variant, names", [
    ("preln", ["h_0_to_17"]),                           # every layer alike
    ("sas", ["h_0", "h_1_to_17"]),                      # first_layer_value_resid_gain
    ("sas_p_nonorm", ["h_0", "h_1_to_17"]),             # layer 0 keeps a LayerNorm
])
def test_the_scan_runs_the_layers_that_share_their_structure(variant, names):
  config = tiny_config(variant, n_layer=18, scan_layers=True)
  model = transformer.build_model(config.model)
  shapes = jax.eval_shape(model.init, jax.random.key(0), TOKENS_BT)["params"]
  assert [k for k in shapes if k.startswith("h_")] == names
  stacked = shapes[names[-1]]["attn"]["c_attn"]["kernel"]
  assert stacked.shape == (len(scan_layout.layers_of(names[-1])), 32, 64)
  config.model.last_layer_proj_resid_gain = 0.5
  assert scan_layout.scanned_layers(config.model) == range(1 if len(names) > 1 else 0, 17)
  assert scan_layout.scanned_layers(tiny_config(variant, n_layer=18).model) is None  # off


def _models(variant, **overrides):
  unrolled = transformer.build_model(tiny_config(variant, n_layer=L).model)
  scanned_config = tiny_config(variant, n_layer=L, scan_layers=True, **overrides).model
  variables = unrolled.init(jax.random.key(0), TOKENS_BT)
  # Zero-initialised weights (SAS queries) would hide a layer mix-up.
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, np.float32),
                           variables)
  scanned_params = scan_layout.stack_layers(variables["params"], scanned_config)
  return unrolled, transformer.build_model(scanned_config), variables, scanned_params


def _loss(model, variables, params):
  logits = model.apply({**variables, "params": params}, TOKENS_BT)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS_BT[:, 1:]).mean()


@pytest.mark.parametrize("variant, remat, residuals", [
    ("sas_p", False, "matmuls"), ("sas", True, "matmuls"), ("preln", False, "all")])
def test_scanned_model_has_the_unrolled_losses_and_gradients(variant, remat, residuals):
  """With remat, or keeping matmul/kernel outputs ("matmuls", the default), or everything."""
  unrolled, scanned, variables, scanned_params = _models(variant, remat=remat,
                                                         scan_residuals=residuals)
  assert jax.tree.structure(scanned_params) == jax.tree.structure(
      jax.eval_shape(scanned.init, jax.random.key(0), TOKENS_BT)["params"])
  grad = lambda model, params: jax.jit(jax.value_and_grad(functools.partial(
      _loss, model, variables)))(params)
  (loss_u, grads_u), (loss_s, grads_s) = (grad(unrolled, variables["params"]),
                                          grad(scanned, scanned_params))
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  grads_s = scan_layout.unstack_layers(grads_s, scanned.cfg)
  assert jax.tree.structure(grads_s) == jax.tree.structure(grads_u)
  for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_scanned_diagnostics_are_named_and_valued_per_layer():
  unrolled, scanned, variables, scanned_params = _models(
      "sas_p", trainable_attn_mat_gains=True)
  def metrics(model, params):
    _, state = model.apply({**variables, "params": params}, TOKENS_BT,
                           mutable=["intermediates"])
    return diagnostics.collect(state["intermediates"], params)
  unrolled_metrics = metrics(unrolled, variables["params"])
  scanned_metrics = metrics(scanned, scanned_params)
  assert set(scanned_metrics) == set(unrolled_metrics)
  assert {"attn_entropy/layer_2", "kurtosis/layer_3"} <= set(scanned_metrics)
  for name, value in unrolled_metrics.items():
    np.testing.assert_allclose(scanned_metrics[name], value, rtol=1e-4, atol=1e-6,
                               err_msg=name)


def test_scanned_decoding_equals_its_full_forward_pass():
  # The fused path's cache has the most parts (keys, values, running value sums).
  _, scanned, variables, scanned_params = _models("sas_p", attention_impl="fused")
  variables = {**variables, "params": scanned_params}
  full_BTV = scanned.apply(variables, TOKENS_BT)
  cache = decode.init_cache(scanned, 2, 16)
  assert cache["h_1_to_3"]["attn"]["value_sum"].shape[0] == 3   # stacked per layer
  apply_cached = jax.jit(functools.partial(decode.apply_cached, scanned))
  prefill_BTV, cache = apply_cached(variables, cache, TOKENS_BT[:, :9])
  step_B1V, _ = apply_cached(variables, cache, TOKENS_BT[:, 9:10])
  np.testing.assert_allclose(prefill_BTV, full_BTV[:, :9], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(step_B1V[:, 0], full_BTV[:, 9], atol=1e-5, rtol=1e-5)


def test_resuming_with_the_switch_flipped_is_refused_naming_it():
  saved = tiny_config("sas_p", n_layer=L).to_dict()
  new = tiny_config("sas_p", n_layer=L, scan_layers=True).to_dict()
  with pytest.raises(compatibility.IncompatibleCheckpointError, match="model.scan_layers"):
    compatibility.check_compatible(saved, new, "ckpt")

"""The signal-propagation diagnostics the papers log (docs/model.md, "Diagnostics", defines
each), as pure functions over arrays; every metric is a float32 scalar.

    _, state = model.apply(variables, tokens_BT, mutable=["intermediates"])
    metrics = collect(state["intermediates"], variables["params"])
    # {"kurtosis/layer_3": f32[], "attn_entropy/layer_0": f32[],
    #  "gain/h_2/attn_mat_skip_gain_mean": f32[], ...}
"""
from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp

from simplified_flax.model import scan_layout
from simplified_flax.training.optimizer import GAIN_SUFFIX, leaf_names

HIDDEN = "hidden"
ATTN_PROBS = "attn_probs"
REPARAM_GAINS = ("resid_gain", "skip_gain")   # leaf names shared by every ReparamLinear
# Gains named with their module (`norm1_alpha_gain`): leaf names several modules of a layer share.
MODULE_QUALIFIED_GAINS = REPARAM_GAINS + ("alpha_gain",   # DyT's and Derf's alpha,
                                          "shift_gain")   # Derf's s (model/layers.py)
_TINY = jnp.finfo(jnp.float32).tiny


def normalised_features(x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(z [N, D], r): x as float32 [N, D] centred over D per token, divided by r, its rms."""
  x_ND = x_BTD.reshape(-1, x_BTD.shape[-1]).astype(jnp.float32)
  x_ND = x_ND - x_ND.mean(axis=-1, keepdims=True)
  rms = jnp.sqrt(jnp.mean(jnp.square(x_ND)))
  return x_ND / jnp.maximum(rms, _TINY), rms


def hidden_state_metrics(x_BTD: jax.Array) -> Dict[str, jax.Array]:
  """The statistics of one layer's hidden state x [B, T, D], with (z, r) its normalised features:
    kurtosis          var_D(diag(z^T z / N)) (docs/model.md, Eq. (8)): 0 iff every neuron
                      carries the same energy, grows with outlier features;
    feature_corr_rms  rms of the off-diagonal entries of z^T z / N  [D, D];
    token_corr_mean / token_corr_rms  mean and rms of the off-diagonal of G = z z^T / D  [N, N];
    max_median_ratio  mean over tokens of max_D |x| / median_D |x| (x as sown);
    hidden_rms        r, the scale of the residual stream.
  Only the [D, D] Gram matrix is formed (O(N D^2) time, O(D^2) memory for any N = B*T), as
  sum(G) = |sum_n z_n|^2 / D, ||G||_F = ||z^T z||_F / D and diag(G)_n = |z_n|^2 / D.
  """
  z_ND, rms = normalised_features(x_BTD)
  N, D = z_ND.shape
  gram_DD = jnp.einsum("nd,ne->de", z_ND, z_ND, precision="highest") / N
  feature_off_sq = jnp.sum(jnp.square(gram_DD)) - jnp.sum(jnp.square(jnp.diagonal(gram_DD)))
  token_diag_N = jnp.sum(jnp.square(z_ND), axis=-1) / D
  token_sum = jnp.sum(jnp.square(jnp.sum(z_ND, axis=0))) / D
  token_off_sq = jnp.sum(jnp.square(gram_DD * N)) / D**2 - jnp.sum(jnp.square(token_diag_N))
  pairs = max(N * (N - 1), 1)
  abs_ND = jnp.abs(x_BTD.reshape(-1, D).astype(jnp.float32))
  median_N = jnp.median(abs_ND, axis=-1)
  return {
      "kurtosis": jnp.var(jnp.diagonal(gram_DD)),
      "feature_corr_rms": jnp.sqrt(jnp.maximum(feature_off_sq, 0.0) / max(D * (D - 1), 1)),
      "token_corr_mean": (token_sum - jnp.sum(token_diag_N)) / pairs,
      "token_corr_rms": jnp.sqrt(jnp.maximum(token_off_sq, 0.0) / pairs),
      "max_median_ratio": jnp.mean(abs_ND.max(axis=-1) / jnp.maximum(median_N, _TINY)),
      "hidden_rms": rms,
  }


def attention_entropy(probs_BHQK: jax.Array) -> jax.Array:
  """Mean over (batch, head, query) rows of -sum_k A log A (masked keys, A = 0, count 0)."""
  p = probs_BHQK.astype(jnp.float32)
  row_entropy_BHQ = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
  return jnp.mean(row_entropy_BHQ)


def gain_metrics(params: Mapping[str, Any]) -> Dict[str, jax.Array]:
  """Every trainable gain: `gain/<top module>/<name>` (vectors: `_mean` and `_std`); a Value /
  Proj gain (`resid_gain` in module `value`) is named as in the config, `value_resid_gain`."""
  metrics = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = leaf_names(path)
    if not names[-1].endswith(GAIN_SUFFIX):
      continue
    name = names[-1]
    if name in MODULE_QUALIFIED_GAINS and len(names) > 2:
      name = f"{names[-2]}_{name}"
    leaf = jnp.asarray(leaf, jnp.float32)
    for module, value in _per_layer(names[0], leaf) if len(names) > 1 else [(None, leaf)]:
      prefix = f"gain/{module}/{name}" if module else f"gain/{name}"
      if value.ndim == 0:
        metrics[prefix] = value
      else:
        metrics[prefix + "_mean"] = jnp.mean(value)
        metrics[prefix + "_std"] = jnp.std(value)
  return metrics


def _per_layer(module: str, leaf):
  """[(module, leaf)], or for a scanned stack `h_<a>_to_<b>` one (`h_<l>`, leaf[i]) per layer
  (metrics named as in the unrolled model)."""
  layers = scan_layout.layers_of(module)
  if layers is None or module == f"h_{layers.start}":
    return [(module, leaf)]
  return [(f"h_{layer}", leaf[i]) for i, layer in enumerate(layers)]


def collect(intermediates: Mapping[str, Any], params: Mapping[str, Any]) -> Dict[str, jax.Array]:
  """Flat `{"<metric>/layer_<l>": f32[]}` from a model's sown intermediates, plus the gains:
  `hidden` holds one block output [B, T, D] per block; `h_<l>/attn/attn_probs` [B, H, T, T] the
  softmax of block l (explicit attention only), or of scanned layers a..b (`h_<a>_to_<b>`)."""
  metrics = {}
  for layer, x_BTD in enumerate(intermediates.get(HIDDEN, ())):
    for name, value in hidden_state_metrics(x_BTD).items():
      metrics[f"{name}/layer_{layer}"] = value
  for name, sub in intermediates.items():
    probs = sub.get("attn", {}).get(ATTN_PROBS) if isinstance(sub, Mapping) else None
    if scan_layout.layers_of(name) is not None and probs:
      for module, probs_BHQK in _per_layer(name, probs[0]):
        metrics[f"attn_entropy/layer_{module[2:]}"] = attention_entropy(probs_BHQK)
  metrics.update(gain_metrics(params))
  return metrics

"""The signal-propagation diagnostics the papers log (docs/model.md, "Diagnostics"), as pure
functions over arrays.

    logits, state = model.apply(variables, tokens_BT, mutable=["intermediates"])
    metrics = collect(state["intermediates"], variables["params"])
    # {"kurtosis/layer_3": f32[], "attn_entropy/layer_0": f32[],
    #  "gain/h_2/attn_mat_skip_gain_mean": f32[], ...}

Per layer hidden state x [B, T, D] (the block's output, sown as "hidden"): centre every token
over D, let r be the rms of all entries and z = x / r as [N, D] (N = B*T). Then
  * kurtosis          var_D(s) (docs/model.md, Eq. (8)) with s = diag(z^T z / N): the
                      per-neuron mean square. mean(s) is
                      1 by construction, so this is zero iff every neuron carries the same
                      energy and grows with outlier features (kurtosis - 1 of the neuron RMS);
  * feature_corr_rms  rms of the off-diagonal entries of z^T z / N  [D, D];
  * token_corr_mean / token_corr_rms  mean and rms of the off-diagonal of z z^T / D  [N, N];
  * max_median_ratio  mean over tokens of max_D |x| / median_D |x| (x as sown, not centred);
  * hidden_rms        r itself (scale of the residual stream).
From the explicit attention path ("attn_probs" [B, H, T, T], absent on the fused path):
  * attn_entropy      mean over (batch, head, query) rows of -sum_k A log A (0 log 0 = 0, so
                      masked keys contribute nothing).
From the parameters: every trainable gain (leaf named `*_gain`), scalars as they are and
per-head vectors as `_mean` / `_std`.

Every metric is a float32 scalar, so the dict can leave a jitted step as it is. The token
statistics use the [D, D] Gram matrix only (||Z Z^T||_F = ||Z^T Z||_F), so their cost is
O(N D^2) and memory O(D^2) however many tokens the batch holds.
"""
from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp

from simplified_flax.model import layer_stack

HIDDEN = "hidden"
ATTN_PROBS = "attn_probs"
GAIN_SUFFIX = "_gain"
REPARAM_GAINS = ("resid_gain", "skip_gain")   # leaf names shared by every ReparamLinear


# --------------------------------------------------------------------------- hidden states

def _centred(x_BTD: jax.Array) -> jax.Array:
  """x as float32 [N, D], centred over D per token."""
  x_ND = x_BTD.reshape(-1, x_BTD.shape[-1]).astype(jnp.float32)
  return x_ND - x_ND.mean(axis=-1, keepdims=True)


def normalised_features(x_BTD: jax.Array) -> jax.Array:
  """z [N, D]: x centred over D per token, divided by the rms of all its entries."""
  x_ND = _centred(x_BTD)
  rms = jnp.sqrt(jnp.mean(jnp.square(x_ND)))
  return x_ND / jnp.maximum(rms, jnp.finfo(jnp.float32).tiny)


def feature_gram(z_ND: jax.Array) -> jax.Array:
  """z^T z / N, [D, D] (float32, full precision)."""
  return jnp.einsum("nd,ne->de", z_ND, z_ND, precision="highest") / z_ND.shape[0]


def kurtosis(x_BTD: jax.Array) -> jax.Array:
  """var over neurons of s = diag(z^T z / N) (docs/model.md, Eq. (8)); 0 iff every neuron has
  the same mean square."""
  s_D = jnp.mean(jnp.square(normalised_features(x_BTD)), axis=0)
  return jnp.var(s_D)


def _off_diagonal_rms(gram_DD: jax.Array) -> jax.Array:
  D = gram_DD.shape[0]
  off_sq = jnp.sum(jnp.square(gram_DD)) - jnp.sum(jnp.square(jnp.diagonal(gram_DD)))
  return jnp.sqrt(jnp.maximum(off_sq, 0.0) / max(D * (D - 1), 1))


def feature_correlation_rms(x_BTD: jax.Array) -> jax.Array:
  """rms of the off-diagonal entries of z^T z / N."""
  return _off_diagonal_rms(feature_gram(normalised_features(x_BTD)))


def token_correlation(x_BTD: jax.Array) -> Dict[str, jax.Array]:
  """Mean and rms of the off-diagonal entries of G = z z^T / D over all N = B*T tokens."""
  z_ND = normalised_features(x_BTD)
  return _token_correlation(z_ND, feature_gram(z_ND))


def _token_correlation(z_ND, gram_DD) -> Dict[str, jax.Array]:
  """Never forms the [N, N] matrix G:  sum(G) = |sum_n z_n|^2 / D,  |G|_F = |z^T z|_F / D,
  and the diagonal of G is |z_n|^2 / D."""
  N, D = z_ND.shape
  pairs = max(N * (N - 1), 1)
  diag_N = jnp.sum(jnp.square(z_ND), axis=-1) / D
  total = jnp.sum(jnp.square(jnp.sum(z_ND, axis=0))) / D
  frob_sq = jnp.sum(jnp.square(gram_DD * N)) / D**2
  off_sq = jnp.maximum(frob_sq - jnp.sum(jnp.square(diag_N)), 0.0)
  return {"mean": (total - jnp.sum(diag_N)) / pairs, "rms": jnp.sqrt(off_sq / pairs)}


def max_median_ratio(x_BTD: jax.Array) -> jax.Array:
  """Mean over tokens of max_D |x| / median_D |x| (scale-free; large with outlier neurons)."""
  abs_ND = jnp.abs(x_BTD.reshape(-1, x_BTD.shape[-1]).astype(jnp.float32))
  median_N = jnp.median(abs_ND, axis=-1)
  return jnp.mean(abs_ND.max(axis=-1) / jnp.maximum(median_N, jnp.finfo(jnp.float32).tiny))


def hidden_state_metrics(x_BTD: jax.Array) -> Dict[str, jax.Array]:
  """Every diagnostic statistic of one layer's hidden state, sharing one Gram matrix."""
  z_ND = normalised_features(x_BTD)
  gram_DD = feature_gram(z_ND)
  tokens = _token_correlation(z_ND, gram_DD)
  return {
      "kurtosis": jnp.var(jnp.diagonal(gram_DD)),
      "feature_corr_rms": _off_diagonal_rms(gram_DD),
      "token_corr_mean": tokens["mean"],
      "token_corr_rms": tokens["rms"],
      "max_median_ratio": max_median_ratio(x_BTD),
      "hidden_rms": jnp.sqrt(jnp.mean(jnp.square(_centred(x_BTD)))),
  }


# -------------------------------------------------------------------------------- attention

def attention_entropy(probs_BHQK: jax.Array) -> jax.Array:
  """Mean over rows of -sum_k A log A; masked keys (A = 0) contribute 0.

  A uniform causal row i (i + 1 visible keys) has entropy log(i + 1).
  """
  p = probs_BHQK.astype(jnp.float32)
  row_entropy_BHQ = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
  return jnp.mean(row_entropy_BHQ)


# ------------------------------------------------------------------------------------ gains

def gain_metrics(params: Mapping[str, Any]) -> Dict[str, jax.Array]:
  """Every trainable gain: `gain/<top module>/<name>` (vectors: `_mean` and `_std`).

  A Value / Proj gain (`resid_gain`, `skip_gain` inside module `value`) is named after its
  module, `value_resid_gain`, as in the config.
  """
  metrics = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [jax.tree_util.keystr((k,), simple=True) for k in path]
    if not names[-1].endswith(GAIN_SUFFIX):
      continue
    name = names[-1]
    if name in REPARAM_GAINS and len(names) > 2:
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
  """[(module, leaf)], or for a scanned stack `h_<a>_to_<b>` one (`h_<l>`, leaf[i]) per layer,
  so that metrics are named as in the unrolled model."""
  layers = layer_stack.layers_of(module)
  if layers is None or module == f"h_{layers.start}":
    return [(module, leaf)]
  return [(f"h_{layer}", leaf[i]) for i, layer in enumerate(layers)]


# ------------------------------------------------------------------------------ everything

def collect(intermediates: Mapping[str, Any], params: Mapping[str, Any]) -> Dict[str, jax.Array]:
  """Flat `{"<metric>/layer_<l>": f32[]}` from a model's sown intermediates, plus the gains.

  `intermediates` is what `model.apply(..., mutable=["intermediates"])` returns under
  "intermediates": `hidden` holds one [B, T, D] per block in order; `h_<l>/attn/attn_probs`
  the softmax of block l (explicit attention only; the entropy is skipped without it), or
  `h_<a>_to_<b>/attn/attn_probs` those of scanned layers a..b stacked (model.scan_layers).
  """
  metrics = {}
  for layer, x_BTD in enumerate(intermediates.get(HIDDEN, ())):
    for name, value in hidden_state_metrics(x_BTD).items():
      metrics[f"{name}/layer_{layer}"] = value
  for name, sub in intermediates.items():
    probs = sub.get("attn", {}).get(ATTN_PROBS) if isinstance(sub, Mapping) else None
    if layer_stack.layers_of(name) is not None and probs:
      for module, probs_BHQK in _per_layer(name, probs[0]):
        metrics[f"attn_entropy/layer_{module[2:]}"] = attention_entropy(probs_BHQK)
  metrics.update(gain_metrics(params))
  return metrics


def collect_if(pred, intermediates, params) -> Dict[str, jax.Array]:
  """`collect` when the traced bool `pred` holds, zeros otherwise (one `lax.cond`).

  Inside a jitted step only the taken branch runs, so the diagnostics cost nothing on the
  steps that skip them, e.g. `collect_if(step % config.diagnostics_every == 0, ...)`.
  """
  shapes = jax.eval_shape(collect, intermediates, params)
  zeros = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.lax.cond(pred, collect, zeros, intermediates, params)

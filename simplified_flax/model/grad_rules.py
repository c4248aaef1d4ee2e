"""Hand-written gradient rules that change speed, never values (`model.grad_rules`).

Both rules compute exactly what plain autodiff computes (to float32 round-off); they only
order the operations of the backward pass so that XLA:CPU lowers them as plain matrix
products instead of strided loops:

* `dense`: `x @ kernel`, with the kernel gradient as `(dy^T x)^T` rather than `x^T dy`. XLA:CPU
  lowers the latter, with the MLP's [tokens, 4D] activations, as a slow transposing loop
  (about a fifth of a Pre-LN step at D=768).
* `fast_gain_gradients(shape)`: the shaped attention matrix `alpha*I + beta*A - gamma*C` with
  each per-head gain's tangent broadcast over (B, Q) first and over K last, so that in
  reverse mode every gain gradient is a row sum before the (B, Q) sum. Autodiff's single
  reduction over (B, Q, K) of a [B, H, Q, K] product is a strided loop on XLA:CPU costing
  a few percent of a SAS step.

`model.grad_rules` ("auto", "on", "off") decides: "auto" uses them on the CPU backend only,
where they were measured to help; "on" / "off" force them (e.g. to measure them on an
accelerator). tests/test_grad_rules.py checks that gradients agree either way.
"""
from typing import Callable

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

MODES = ("auto", "on", "off")


def enabled(mode: str) -> bool:
  """Whether the rules apply under `mode` on the current default backend."""
  if mode == "auto":
    return jax.default_backend() == "cpu"
  if mode in ("on", "off"):
    return mode == "on"
  raise ValueError(f"model.grad_rules={mode!r} is unknown: use one of {list(MODES)}.")


def mode_of(model_config) -> str:
  """The config's mode; "auto" for configs saved before the field existed."""
  return model_config.get("grad_rules", "auto")


def matmul(mode: str) -> Callable:
  """`x @ kernel` over the last axis: `dense` when the rules apply, else `jnp.dot`."""
  return dense if enabled(mode) else jnp.dot


def _present(tangent) -> bool:
  """A symbolic-zero tangent (an input that is not differentiated) costs nothing."""
  return tangent is not None and not isinstance(tangent, SymbolicZero)


@jax.custom_jvp
def dense(x_ND, kernel_DF):
  """`x @ kernel` over the last axis of x, [..., D] x [D, F] -> [..., F] (see module doc)."""
  return jnp.dot(x_ND, kernel_DF)


def _dense_jvp(primals, tangents):
  x_ND, kernel_DF = primals
  dx_ND, dkernel_DF = tangents
  y_NF = jnp.dot(x_ND, kernel_DF)
  dy_NF = jnp.zeros_like(y_NF)
  if _present(dx_ND):
    dy_NF = dy_NF + jnp.dot(dx_ND, kernel_DF)
  if _present(dkernel_DF):
    x_2D = x_ND.reshape(-1, x_ND.shape[-1])
    dy_NF = dy_NF + jnp.dot(dkernel_DF.T, x_2D.T).T.reshape(y_NF.shape)
  return y_NF, dy_NF


dense.defjvp(_dense_jvp, symbolic_zeros=True)


def _per_row(gain_H, like_BHQK):
  """A per-head [H] tangent broadcast to [B, H, Q, 1] (then over keys by the product)."""
  B, H, Q, _ = like_BHQK.shape
  return jnp.broadcast_to(gain_H[None, :, None], (B, H, Q))[..., None]


def fast_gain_gradients(shape: Callable) -> Callable:
  """`shape` (`attention.shape_attention_matrix`: (A', softmax A)) with the gain-gradient rule
  of the module docstring; same values. `eye_QK` and `centre_QK` come from the mask and are
  constants: their tangents are ignored.
  """
  @jax.custom_jvp
  def fast_shape(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK):
    return shape(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK)

  def jvp(primals, tangents):
    logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK = primals
    d_logits_BHQK, d_resid_H, d_skip_H, d_centre_H, _, _ = tangents
    shaped_BHQK, probs_BHQK = shape(*primals)
    d_probs_BHQK = jnp.zeros_like(probs_BHQK)
    if _present(d_logits_BHQK):   # the softmax's own JVP
      d_probs_BHQK = probs_BHQK * (
          d_logits_BHQK - jnp.sum(probs_BHQK * d_logits_BHQK, axis=-1, keepdims=True))
    d_shaped_BHQK = resid_H.reshape(-1, 1, 1) * d_probs_BHQK
    if _present(d_resid_H):
      d_shaped_BHQK = d_shaped_BHQK + _per_row(d_resid_H, probs_BHQK) * probs_BHQK
    if skip_H is not None and _present(d_skip_H):
      d_shaped_BHQK = d_shaped_BHQK + _per_row(d_skip_H, probs_BHQK) * eye_QK
    if centre_H is not None and _present(d_centre_H):
      d_shaped_BHQK = d_shaped_BHQK - _per_row(d_centre_H, probs_BHQK) * centre_QK
    return (shaped_BHQK, probs_BHQK), (d_shaped_BHQK, d_probs_BHQK)

  fast_shape.defjvp(jvp, symbolic_zeros=True)
  return fast_shape

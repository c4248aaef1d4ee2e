"""Hand-written gradient rules that change speed, never values (`model.grad_rules`).

Both give autodiff's gradients (to float32 round-off) in an order XLA:CPU lowers as matrix
products, not strided loops: `dense`, the kernel gradient as `(dy^T x)^T` rather than `x^T dy`
(a fifth of a Pre-LN step at D=768); `fast_gain_gradients`, each per-head gain's gradient as a
row sum before the (B, Q) sum (a few percent of a SAS step).

The mode ("auto": on the CPU platform only, where they were measured to help; "on"; "off") is
chosen once: `Transformer` traces its body inside `chosen(model.grad_rules)`, and `matmul` and
the attention read it at trace time (so under jit, scan and remat alike).
"""
import contextlib
import contextvars

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

from simplified_flax.model import target_platform

MODES = ("auto", "on", "off")
_MODE = contextvars.ContextVar("grad_rules_mode", default="auto")


def mode_of(model_config) -> str:
  """The config's mode ("auto" for configs saved before the field existed)."""
  return model_config.get("grad_rules", "auto")


@contextlib.contextmanager
def chosen(mode: str):
  """Within the context, models trace with the rules under `mode`."""
  token = _MODE.set(mode)
  try:
    yield
  finally:
    _MODE.reset(token)


def enabled() -> bool:
  """Whether the rules apply under the chosen mode on the platform the step is compiled for."""
  mode = _MODE.get()
  return mode == "on" or (mode == "auto" and target_platform.current() == "cpu")


def matmul(x_ND, kernel_DF):
  """`x @ kernel` over the last axis: `dense` when the rules apply, else `jnp.dot`."""
  return dense(x_ND, kernel_DF) if enabled() else jnp.dot(x_ND, kernel_DF)


def _present(tangent) -> bool:
  """A symbolic-zero tangent (an input not differentiated) costs nothing."""
  return tangent is not None and not isinstance(tangent, SymbolicZero)


@jax.custom_jvp
def dense(x_ND, kernel_DF):
  """`x @ kernel`, [..., D] x [D, F] -> [..., F], with the kernel-gradient rule above."""
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


def fast_gain_gradients(shape):
  """`shape(logits_BHQK, resid_H, terms) -> (A', A)` (`attention.shape_attention_matrix`,
  A' = resid * softmax(logits) + the sum of gain * matrix over the `terms`) with the gain rule
  above, for any number of terms. The matrices are constants: their tangents are ignored."""
  @jax.custom_jvp
  def fast_shape(logits_BHQK, resid_H, terms):
    return shape(logits_BHQK, resid_H, terms)

  def jvp(primals, tangents):
    _, resid_H, terms = primals
    d_logits_BHQK, d_resid_H, d_terms = tangents
    shaped_BHQK, probs_BHQK = shape(*primals)
    B, H, Q, _ = probs_BHQK.shape
    per_row = lambda d_gain_H: jnp.broadcast_to(d_gain_H[None, :, None], (B, H, Q))[..., None]
    d_probs_BHQK = jnp.zeros_like(probs_BHQK)
    if _present(d_logits_BHQK):   # the softmax's own JVP
      d_probs_BHQK = probs_BHQK * (
          d_logits_BHQK - jnp.sum(probs_BHQK * d_logits_BHQK, axis=-1, keepdims=True))
    d_shaped_BHQK = resid_H.reshape(-1, 1, 1) * d_probs_BHQK
    if _present(d_resid_H):
      d_shaped_BHQK = d_shaped_BHQK + per_row(d_resid_H) * probs_BHQK
    for (_, matrix), (d_gain_H, _) in zip(terms, d_terms):
      if _present(d_gain_H):
        d_shaped_BHQK = d_shaped_BHQK + per_row(d_gain_H) * matrix
    return (shaped_BHQK, probs_BHQK), (d_shaped_BHQK, d_probs_BHQK)

  fast_shape.defjvp(jvp, symbolic_zeros=True)
  return fast_shape

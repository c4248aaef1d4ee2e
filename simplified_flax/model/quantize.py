"""Fake-quantised evaluation: every linear layer's inputs and weights rounded to int8 and back.

    with quantize.applied("w8a8"):
      logits = model.apply(variables, tokens_BT)     # trace under the context: jit, eval_step
    step = quantize.quantized(eval_step, "w8a8")   # the same, as a function to compile

The scheme (the W8A8 setting of He et al. 2024, "Understanding and Minimising Outlier
Features", Sec. 6), symmetric round-to-nearest int8, zero point 0, codes in [-127, 127]:
  * activations (`a8`): per tensor and dynamic, one scale max|x| / 127 for the whole input of a
    layer in this call (all batch rows and tokens together), so one outlier neuron coarsens the
    grid of every other neuron;
  * weights (`w8`): per output channel, one scale max_i |W[i, j]| / 127 per output column j of
    the layer's [fan_in, fan_out] matrix (its effective matrix, for a reparameterised
    Value/Proj `resid_gain * W + skip_gain * W0`);
  * `w8a8` both. Biases, norms, attention scores/softmax, embeddings lookups and the residual
    stream stay in full precision.
The layers are every `layers.Projection`: the query-key projection, Value and Proj where they
are matrices (not the identity form), both MLP matrices and the tied head (the embedding as a
[D, V] matrix, one scale per vocabulary entry). A Flax method interceptor reaches them, so the
model code carries no quantisation switch; a projection applies `project(x, kernel_DF)`, which
is what the interceptor rewrites.
"""
import contextlib
import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

SCHEMES = ("none", "w8", "a8", "w8a8")
PROJECT_METHOD = "project"   # the method of layers.Projection the interceptor rewrites


def fake_quantize(x: jax.Array, bits: int = 8, channel_axis: Optional[int] = None) -> jax.Array:
  """x rounded to a symmetric `bits`-bit grid and back, in x's dtype (computed in float32).

  `channel_axis=None`: one scale for the whole tensor; otherwise one per index of that axis
  (the maximum over every other axis). scale = max|x| / (2^(bits-1) - 1), so the largest
  entry is exact, every entry lands within scale / 2 of its value, and an all-zero slice stays
  zero. The rounding has no gradient worth using: this is for evaluation.
  """
  levels = 2 ** (bits - 1) - 1
  x32 = x.astype(jnp.float32)
  if channel_axis is None:
    amax = jnp.max(jnp.abs(x32))
  else:
    axis = channel_axis % x.ndim
    amax = jnp.max(jnp.abs(x32), axis=tuple(a for a in range(x.ndim) if a != axis),
                   keepdims=True)
  scale = jnp.where(amax > 0, amax / levels, 1.0)
  return (jnp.clip(jnp.round(x32 / scale), -levels, levels) * scale).astype(x.dtype)


def parse_scheme(scheme: str | None) -> tuple[bool, bool]:
  """(quantise weights, quantise activations) of "none" / "w8" / "a8" / "w8a8" (None: none)."""
  scheme = scheme or "none"
  if scheme not in SCHEMES:
    raise ValueError(f"--quantize={scheme!r} is unknown: use one of {list(SCHEMES)}.")
  return "w8" in scheme, "a8" in scheme


def interceptor(scheme: str, bits: int = 8) -> Callable:
  """A Flax method interceptor that fake-quantises the (x, kernel_DF) of every projection."""
  weights, activations = parse_scheme(scheme)

  def intercept(next_fun, args, kwargs, context):
    if context.method_name != PROJECT_METHOD:
      return next_fun(*args, **kwargs)
    x, kernel_DF = args
    if activations:
      x = fake_quantize(x, bits)
    if weights:
      kernel_DF = fake_quantize(kernel_DF, bits, channel_axis=-1)
    return next_fun(x, kernel_DF, **kwargs)

  return intercept


@contextlib.contextmanager
def applied(scheme: str | None, bits: int = 8):
  """Within the context, models apply (and trace) with `scheme`; "none" changes nothing."""
  if parse_scheme(scheme) == (False, False):
    yield
    return
  with nn.intercept_methods(interceptor(scheme, bits)):
    yield


def quantized(fn: Callable, scheme: str | None, bits: int = 8) -> Callable:
  """`fn` (e.g. `step.eval_step`) tracing its model under `scheme`. A new function, so that a
  jit cache keyed on `fn` never hands back the full-precision trace."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with applied(scheme, bits):
      return fn(*args, **kwargs)
  return wrapped

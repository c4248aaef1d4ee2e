"""Fake-quantised evaluation: every linear layer's inputs and weights rounded to int8 and back.

    with quantize.applied("w8a8"):
      logits = model.apply(variables, tokens_BT)     # trace under the context: jit, eval_step
    step = quantize.quantized(eval_step, "w8a8")   # the same, as a function to compile

W8A8 of [OP] Sec. 6: symmetric int8, codes in [-127, 127]. `a8`: one dynamic scale max|x| / 127
per layer input (one outlier neuron coarsens every other's grid); `w8`: one per output column
of the [fan_in, fan_out] (effective) matrix; `w8a8` both. Every linear layer passes (x, kernel)
through `operands`, which reads the context's scheme at trace time.
"""
import contextlib
import contextvars
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

SCHEMES = ("none", "w8", "a8", "w8a8")
_ACTIVE = contextvars.ContextVar("quantize_scheme", default=(False, False, 8))


def fake_quantize(x: jax.Array, bits: int = 8, channel_axis: Optional[int] = None) -> jax.Array:
  """x rounded to a symmetric `bits`-bit grid and back, in x's dtype (computed in float32), one
  scale max|x| / (2^(bits-1) - 1) for the tensor or per index of `channel_axis`: the largest
  entry is exact, every entry within scale / 2, an all-zero slice zero. No useful gradient."""
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


def operands(x, kernel_DF):
  """(x, kernel [D, F]) of a linear layer, fake-quantised as the context's scheme says."""
  weights, activations, bits = _ACTIVE.get()
  if activations:
    x = fake_quantize(x, bits)
  if weights:
    kernel_DF = fake_quantize(kernel_DF, bits, channel_axis=-1)
  return x, kernel_DF


def is_applied() -> bool:
  """Whether the context fake-quantises anything (a layer must then take its operands from
  `operands`)."""
  weights, activations, _ = _ACTIVE.get()
  return weights or activations


@contextlib.contextmanager
def applied(scheme: str | None, bits: int = 8):
  """Within the context, models apply (and trace) with `scheme`; "none" changes nothing."""
  token = _ACTIVE.set((*parse_scheme(scheme), bits))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def quantized(fn: Callable, scheme: str | None, bits: int = 8) -> Callable:
  """`fn` (e.g. `step.eval_step`) tracing its model under `scheme`. A new function, so that a
  jit cache keyed on `fn` never hands back the full-precision trace."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with applied(scheme, bits):
      return fn(*args, **kwargs)
  return wrapped

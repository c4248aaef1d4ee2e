"""The fused path's kernels: which backend takes which, and the TPU splash kernel (run in Pallas
interpret mode on CPU) equals the explicit shaped attention, outputs and gradients
(`fast/attention_kernels.py`, through `fast.attention.shaped_attention` under a TPU's plan)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import attention_kernels
from simplified_flax.fast.plan import Plan

B, T, H, DH = 1, 128, 2, 8      # the smallest sequence the splash kernel tiles (one block)
GAINS = dict(resid_gain=jnp.array([1.0, 0.5]), skip_gain=jnp.array([0.3, 1.0]),
             centre_gain=jnp.array([0.9, 0.2]))


def _qkv(dtype=jnp.float32, t=T):
  keys = jax.random.split(jax.random.key(1), 3)
  return [jax.random.normal(key, (B, t, H, DH), dtype) for key in keys]


def test_each_backend_picks_its_kernel_and_falls_back_to_xla(monkeypatch):
  q, k, _ = _qkv()
  mask = jnp.ones((B, 1, T, T), bool)
  choose = attention_kernels.choose_kernel
  assert choose(q, k, mask=None, backend="tpu") == "splash"
  assert choose(q, k, mask=mask, backend="tpu") == "xla"            # padding/packing masks
  assert choose(q[:, :1], k, mask=None, backend="tpu") == "xla"     # a KV cache's Tq != Tk
  assert choose(*_qkv(t=100)[:2], mask=None, backend="tpu") == "xla"  # not a whole tile
  assert choose(q.astype(jnp.bfloat16), k, mask=None, backend="gpu") == "cudnn"
  assert choose(q, k, mask=None, backend="gpu") == "xla"            # cuDNN takes no float32
  assert choose(q, k, mask=None, backend="cpu") == "xla"
  monkeypatch.setenv(attention_kernels.KERNEL_ENV, "xla")
  assert choose(q, k, mask=None, backend="tpu") == "xla"


@pytest.mark.parametrize("causal", [True, False])
def test_splash_kernel_equals_the_explicit_path(causal):
  # A TPU's plan, the splash kernel interpreted; no rules, so that the combine is XLA's and
  # the kernel alone is under test (tests/test_combine_kernel.py tests the combine's).
  on_tpu = Plan("tpu", frozenset(), "fused", interpret=True)
  q, k, v = _qkv()
  fused = lambda q, k, v: fast_attention.shaped_attention(on_tpu, q, k, v, causal=causal,
                                                          impl="fused", **GAINS)
  assert "pallas_call" in str(jax.make_jaxpr(fused)(q, k, v))   # the kernel, not XLA

  def loss(impl, q, k, v, gains):
    out = fast_attention.shaped_attention(on_tpu, q, k, v, causal=causal, impl=impl, **gains)
    return jnp.sum(jnp.sin(out)), out

  grad = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3),
                                       has_aux=True))(q, k, v, GAINS)
  (g_fused, out_fused), (g_explicit, out_explicit) = grad("fused"), grad("explicit")
  np.testing.assert_allclose(out_fused, out_explicit, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_explicit)):
    np.testing.assert_allclose(a, b, atol=1e-4)

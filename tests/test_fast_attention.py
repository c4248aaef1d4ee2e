"""Shaped attention of the speed package (`fast/attention.py`), on the CPU under explicit plans:
the TPU's forms (chunk-matmul prefix sums, a held combine) and the `gains` rule's hand-written
JVP keep the reference's values and gradients (tests/test_attention.py tests the reference)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import attention_kernels
from simplified_flax.fast.plan import Plan
from test_attention import CASES, GAINS, check_explicit_gradients_against_the_formula, qkv

# "on" on a CPU: the `gains` rule on the explicit path (the combine kernels need a causal mean
# with no mask; tests/test_combine_kernel.py).
GAINS_RULE = Plan("cpu", frozenset({"gains"}), "explicit")


def _loss(plan, impl, case, **extra):
  def f(q, k, v, gains):
    out = fast_attention.shaped_attention(plan, q, k, v, impl=impl, **gains, **case, **extra)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))   # a generic, non-linear read-out
  return f


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefix_sums_by_chunk_matmuls_equal_the_cumulative_sum(dtype):
  """The TPU form, over two chunks: the same sums (bfloat16 or float32 values, float32 sums:
  exact for these integers)."""
  v = jax.random.randint(jax.random.key(1), (1, 2 * fast_attention.PREFIX_CHUNK, 2, 4), -8, 8)
  v = v.astype(dtype)
  by_chunks = lambda v: fast_attention.causal_prefix_sums(v, by_chunks=True)
  assert "dot_general" in str(jax.make_jaxpr(by_chunks)(v))
  np.testing.assert_array_equal(by_chunks(v), jnp.cumsum(v.astype(jnp.float32), axis=1))


def test_the_tpu_form_of_the_fused_path_equals_the_explicit_one(monkeypatch):
  """Chunk-matmul prefix sums and a held combine (TPU_LAYOUT_PLATFORMS,
  HELD_COMBINE_PLATFORMS) under a TPU's plan without rules, here on the CPU over two chunks:
  outputs and gradients as the explicit path's. A v is XLA's (the splash kernel:
  tests/test_attention_kernels.py)."""
  monkeypatch.setenv(attention_kernels.KERNEL_ENV, "xla")
  on_tpu = Plan("tpu", frozenset(), "fused", interpret=True)
  assert on_tpu.platform in fast_attention.TPU_LAYOUT_PLATFORMS
  assert on_tpu.platform in fast_attention.HELD_COMBINE_PLATFORMS
  T2 = 2 * fast_attention.PREFIX_CHUNK
  kq, kk, kv = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(key, (1, T2, 2, 4)) for key in (kq, kk, kv))
  gains = {name: g[:2] for name, g in GAINS.items()}
  fused = lambda q, k, v: fast_attention.shaped_attention(on_tpu, q, k, v, causal=True,
                                                          impl="fused", **gains)
  assert "pallas_call" not in str(jax.make_jaxpr(fused)(q, k, v))   # XLA's A v and combine
  loss = lambda impl: jax.jit(jax.value_and_grad(_loss(on_tpu, impl, dict(causal=True)),
                                                argnums=(0, 1, 2, 3)))
  (out_e, grads_e), (out_f, grads_f) = (loss(i)(q, k, v, gains) for i in ("explicit", "fused"))
  np.testing.assert_allclose(out_e, out_f, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_e), jax.tree.leaves(grads_f)):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("name", ["causal", "bidirectional_padded", "packed_causal"])
def test_explicit_gradients_under_the_gains_rule_equal_autodiff_of_the_formula(name):
  """The explicit path's hand-written JVP (the `gains` rule of grad_rules.py), with a loss that
  also reads the returned softmax (as diagnostics or an attention-entropy penalty would)."""
  case = CASES[name]
  q, k, v = qkv()
  jaxpr = lambda plan: str(jax.make_jaxpr(lambda q, k, v: fast_attention.shaped_attention(
      plan, q, k, v, **GAINS, **case, return_probs=True))(q, k, v))
  assert "custom_jvp" in jaxpr(GAINS_RULE)   # the rule's JVP, not autodiff's
  assert "custom_jvp" not in jaxpr(Plan("cpu", frozenset(), "explicit"))
  check_explicit_gradients_against_the_formula(
      functools.partial(fast_attention.shaped_attention, GAINS_RULE), name)

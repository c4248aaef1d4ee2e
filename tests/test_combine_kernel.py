"""The causal combine's Pallas kernels (`fast/combine_kernel.py` for GPUs,
`fast/combine_kernel_tpu.py` for TPUs; the `combine` rule of `fast.grad_rules`), run in
interpret mode on the CPU: values and every gradient as the XLA form of Eq. (6), to float32
round-off (bfloat16: one rounding of the result)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import combine_kernel
from simplified_flax.fast import combine_kernel_tpu
from simplified_flax.fast import grad_rules
from simplified_flax.fast.plan import Plan
from simplified_flax.model import attention

B = 2


def _inputs(T, H, d, dtype, with_addend):
  keys = jax.random.split(jax.random.key(0), 7)
  av, v, cotangent = (jax.random.normal(k, (B, T, H, d)).astype(dtype) for k in keys[:3])
  gains_and_addend = [jax.random.normal(k, (H,)) for k in keys[3:6]]
  if with_addend:   # a parallel block's other branch
    gains_and_addend.append(jax.random.normal(keys[6], (B, T, H, d)).astype(dtype))
  return av, v, gains_and_addend, cotangent


def _xla_combine(T, has_skip):
  def combine(av, v, resid, skip, centre, *addend):
    terms = [(skip, v)] if has_skip else []
    terms.append((centre, -attention.centred_values(v, causal=True, num_queries=T)))
    if addend:   # summed before the one rounding, as the kernels do
      terms.append((1.0, *addend))
    return attention.combine_fused_terms(av, resid, terms)
  return combine


def _kernels(has_skip, backend):
  def combine(av, v, resid, skip, centre, *addend):
    return combine_kernel.causal_combine(av, v, resid, skip, centre, has_skip, True, *addend,
                                         backend=backend)
  return combine


# GPU: two chunks with the skip and an addend; one short chunk with neither. TPU (Mosaic's
# kernels, [B, H, T, d] blocks): two chunks of 128 times, two heads of 64 lanes side by side
# in the [B, T, D] addend and result; one chunk with 3 heads of 16 (all heads in one block).
@pytest.mark.parametrize("backend,T,H,d,has_skip,with_addend",
                         [("gpu", 64, 3, 16, True, True), ("gpu", 16, 3, 16, False, False),
                          ("tpu", 256, 2, 64, True, True), ("tpu", 128, 3, 16, False, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernels_give_the_xla_combine_and_its_gradients(backend, T, H, d, has_skip,
                                                            with_addend, dtype):
  av, v, gains_and_addend, cotangent = _inputs(T, H, d, dtype, with_addend)
  want, want_vjp = jax.vjp(_xla_combine(T, has_skip), av, v, *gains_and_addend)
  got, got_vjp = jax.vjp(_kernels(has_skip, backend), av, v, *gains_and_addend)
  assert got.dtype == want.dtype == dtype
  one_rounding = 0 if dtype == jnp.float32 else 2.0 ** -7   # bfloat16's relative step
  np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=one_rounding, atol=1e-5)
  names = ("d(A v)", "dv", "d resid", "d skip", "d centre", "d addend")
  for name, g, w in zip(names, got_vjp(cotangent), want_vjp(cotangent)):
    if name == "d skip" and not has_skip:
      np.testing.assert_array_equal(g, 0.0)
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, name
    scale = np.abs(np.float32(w)).max()
    # float32: a few steps of the largest value, the sums being associated differently (the
    # steps differ with the host CPU's vector width).
    tol = max(one_rounding, 2.0 ** -20) * scale if g.ndim == 4 else 1e-5 * scale
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=0, atol=tol + 1e-6,
                               err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gpu_forward_writes_the_sums_of_squares_of_its_rounded_result(dtype):
  """`sum_squares=True`: the same result, its per-token sum of squares over the heads (as a
  norm reading the stored result sums them), and the same gradients (the sums undifferentiated)."""
  av, v, gains_and_addend, cotangent = _inputs(64, 3, 16, dtype, False)
  combine = lambda *args, **kw: combine_kernel.causal_combine(*args[:5], True, True, **kw)
  want, want_vjp = jax.vjp(combine, av, v, *gains_and_addend)
  (got, sums_BT), got_vjp = jax.vjp(functools.partial(combine, sum_squares=True), av, v,
                                    *gains_and_addend)
  np.testing.assert_array_equal(np.float32(got), np.float32(want))
  assert sums_BT.shape == (B, 64) and sums_BT.dtype == jnp.float32
  np.testing.assert_allclose(sums_BT, jnp.sum(jnp.square(np.float32(got)), axis=(2, 3)),
                             rtol=1e-6)
  for g, w in zip(got_vjp((cotangent, jnp.ones_like(sums_BT))), want_vjp(cotangent)):
    np.testing.assert_array_equal(np.float32(g), np.float32(w))
  with pytest.raises(ValueError, match="GPU"):
    combine(av, v, *gains_and_addend, backend="tpu", sum_squares=True)


def test_the_tpu_kernels_take_whole_lanes_of_heads_and_chunks_of_128_times():
  assert [combine_kernel_tpu.heads_per_program(H, d) for H, d in
          ((12, 64), (16, 128), (12, 256), (3, 16), (12, 96))] == [2, 1, 1, 3, 12]
  supported = lambda *shape: combine_kernel_tpu.supported(jnp.ones(shape))
  assert supported(1, 256, 12, 64) and not supported(1, 192, 12, 64)


def test_shaped_attention_takes_the_kernels_only_for_the_plain_causal_mean_under_the_rule():
  q = k = v = jnp.ones((1, 32, 2, 8))
  gains = dict(resid_gain=1.0, skip_gain=jnp.array([0.5, 1.0]), centre_gain=1.0)
  every_rule = Plan("cpu", frozenset(grad_rules.AUTO_PLATFORM), "fused")   # "on" on a CPU
  no_combine = Plan("cpu", frozenset(grad_rules.AUTO_PLATFORM) - {"combine"}, "fused")
  jaxpr = lambda plan, **kw: str(jax.make_jaxpr(lambda q, k, v: fast_attention.shaped_attention(
      plan, q, k, v, impl="fused", causal=True, **gains, **kw))(q, k, v))
  on = jaxpr(every_rule)
  padded = jaxpr(every_rule, key_mask=jnp.ones((1, 32), bool))
  off = jaxpr(no_combine)
  reference = str(jax.make_jaxpr(lambda q, k, v: attention.shaped_attention(
      q, k, v, impl="fused", causal=True, **gains))(q, k, v))
  assert "pallas_call" in on and "pallas_call" not in padded and "pallas_call" not in off
  assert "pallas_call" not in reference
  supported = lambda *shape: combine_kernel.supported(jnp.ones(shape), min_programs=1)
  assert supported(1, 96, 2, 8) and supported(1, 16, 2, 8)
  assert not supported(1, 24, 2, 8)    # no chunk divides 24
  assert not supported(1, 32, 2, 12)   # d not a power of two
  # On a GPU: enough (sequence, head) programs to fill it (batch 1 at long T is left to XLA).
  assert combine_kernel.supported(jnp.ones((128, 32, 12, 8)))
  assert not combine_kernel.supported(jnp.ones((1, 16384, 12, 8)))

"""Shaped attention of the reference model (`model/attention.py`): the centering matrices, and
explicit == fused (outputs and gradients). The speed package's form:
tests/test_fast_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.model import attention
from simplified_flax.model import masks

B, T, H, DH = 2, 9, 3, 4
KEY_MASK = jnp.array([[1] * 6 + [0] * 3, [1] * 9], bool)           # row 0 right-padded
SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 2, 2, 2, 2]])
GAINS = dict(resid_gain=jnp.array([1.0, 0.5, 2.0]), skip_gain=jnp.array([0.3, 1.0, 0.7]),
             centre_gain=jnp.array([0.9, 0.2, 1.1]))


def qkv(dtype=jnp.float32, num_queries=T):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, num_queries, H, DH), dtype)
  k = jax.random.normal(kk, (B, T, H, DH), dtype)
  v = jax.random.normal(kv, (B, T, H, DH), dtype)
  return q, k, v


def test_causal_centering_matrix_rows_average_the_prefix():
  C = np.asarray(attention.centering_matrix(5, 5, causal=True))[0]
  expected = np.tril(np.ones((5, 5))) / np.arange(1, 6)[:, None]
  np.testing.assert_allclose(C, expected, rtol=0, atol=1e-7)
  offset = attention.centering_matrix(2, 5, causal=True, query_offset=3)[0]
  np.testing.assert_allclose(offset, expected[3:5], atol=1e-7)


def test_bidirectional_centering_matrix_ignores_padding_keys():
  C = np.asarray(attention.centering_matrix(T, T, causal=False, key_mask=KEY_MASK))
  np.testing.assert_allclose(C[0, :, :6], 1 / 6)
  np.testing.assert_allclose(C[0, :, 6:], 0)
  np.testing.assert_allclose(C[1], 1 / 9)


def test_packed_centering_matrix_is_block_diagonal():
  C = np.asarray(attention.centering_matrix(T, T, causal=True, segment_ids=SEGMENTS))
  np.testing.assert_allclose(C[0, 3, 3], 1.0)        # first token of segment 2 sees only itself
  np.testing.assert_allclose(C[0, 4, :], [0, 0, 0, .5, .5, 0, 0, 0, 0])
  bidi = np.asarray(attention.centering_matrix(T, T, causal=False, segment_ids=SEGMENTS))
  np.testing.assert_allclose(bidi[1, 0], [.2] * 5 + [0] * 4)
  np.testing.assert_allclose(bidi.sum(-1), 1.0, rtol=1e-6)


CASES = {
    "causal": dict(causal=True),
    "bidirectional_padded": dict(causal=False, key_mask=KEY_MASK),
    "packed_causal": dict(causal=True, segment_ids=SEGMENTS),
    "packed_bidirectional": dict(causal=False, segment_ids=SEGMENTS),
    "causal_padded_packed": dict(causal=True, segment_ids=SEGMENTS, key_mask=KEY_MASK),
}


def _loss(impl, case, **extra):
  def f(q, k, v, gains):
    out = attention.shaped_attention(q, k, v, impl=impl, **gains, **case, **extra)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))   # a generic, non-linear read-out
  return f


@pytest.mark.parametrize("name", sorted(CASES))
def test_explicit_and_fused_agree_outputs_and_gradients(name):
  case = CASES[name]
  q, k, v = qkv()
  outs = {impl: attention.shaped_attention(q, k, v, impl=impl, **GAINS, **case)
          for impl in ("explicit", "fused")}
  np.testing.assert_allclose(outs["explicit"], outs["fused"], atol=1e-5)
  grads = {impl: jax.grad(_loss(impl, case), argnums=(0, 1, 2, 3))(q, k, v, GAINS)
           for impl in ("explicit", "fused")}
  for g_explicit, g_fused in zip(jax.tree.leaves(grads["explicit"]),
                                 jax.tree.leaves(grads["fused"])):
    np.testing.assert_allclose(g_explicit, g_fused, atol=1e-5)


def test_queries_offset_into_longer_keys_match_full_sequence():
  q_full, k, v = qkv()
  q = q_full[:, 5:8]
  rows = {impl: attention.shaped_attention(q, k, v, causal=True, query_offset=5, impl=impl,
                                           **GAINS) for impl in ("explicit", "fused")}
  full = attention.shaped_attention(q_full, k, v, causal=True, impl="explicit", **GAINS)
  np.testing.assert_allclose(rows["explicit"], full[:, 5:8], atol=1e-6)
  np.testing.assert_allclose(rows["fused"], full[:, 5:8], atol=1e-5)
  g = {impl: jax.grad(_loss(impl, dict(causal=True), query_offset=5), argnums=(0, 1, 2, 3))(
      q, k, v, GAINS) for impl in ("explicit", "fused")}
  for a, b in zip(jax.tree.leaves(g["explicit"]), jax.tree.leaves(g["fused"])):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_per_head_gains_act_per_head():
  q, k, v = qkv()
  gains = dict(GAINS, resid_gain=jnp.array([1.0, 0.0, 1.0]))
  out = attention.shaped_attention(q, k, v, causal=True, **gains)
  ref = attention.shaped_attention(q, k, v, causal=True, **GAINS)
  np.testing.assert_allclose(out[:, :, 0], ref[:, :, 0], atol=1e-6)
  assert not np.allclose(out[:, :, 1], ref[:, :, 1])


def test_bfloat16_paths_agree_loosely():
  q, k, v = qkv(jnp.bfloat16)
  for case in CASES.values():
    e = attention.shaped_attention(q, k, v, impl="explicit", **GAINS, **case)
    f = attention.shaped_attention(q, k, v, impl="fused", **GAINS, **case)
    assert e.dtype == f.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(e, np.float32), np.asarray(f, np.float32), atol=5e-2)


@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=False, key_mask=KEY_MASK)])
def test_zero_queries_and_unit_gains_make_attention_the_identity(case):
  _, k, v = qkv()
  q = jnp.zeros((B, T, H, DH))
  ones = jnp.ones(H)
  for impl in ("explicit", "fused"):
    out = attention.shaped_attention(q, k, v, resid_gain=ones, skip_gain=ones,
                                     centre_gain=ones, impl=impl, **case)
    real = np.asarray(case.get("key_mask", jnp.ones((B, T), bool)))
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(v)[real], atol=1e-6)


def test_explicit_returns_softmax_probabilities():
  q, k, v = qkv()
  _, probs = attention.shaped_attention(q, k, v, causal=True, return_probs=True, **GAINS)
  assert probs.shape == (B, H, T, T)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
  assert float(jnp.abs(jnp.triu(probs, 1)).max()) == 0.0


def test_fused_epilogue_never_builds_a_time_by_time_array():
  _, _, v = qkv()
  for kwargs in [dict(causal=True, segment_ids=SEGMENTS), dict(causal=False, key_mask=KEY_MASK)]:
    jaxpr = jax.make_jaxpr(lambda v: attention.centred_values(v, num_queries=T, **kwargs))(v)
    shapes = [var.aval.shape for eqn in jaxpr.eqns for var in eqn.outvars]
    assert all(list(s).count(T) < 2 for s in shapes), shapes


def test_plain_attention_and_bad_impl():
  q, k, v = qkv()
  plain = lambda **kw: attention.shaped_attention(q, k, v, resid_gain=1.0, skip_gain=None,
                                                  centre_gain=None, causal=True, **kw)
  np.testing.assert_allclose(plain(impl="fused"), plain(), atol=1e-5)
  with pytest.raises(ValueError, match="Unknown attention impl 'flash'"):
    plain(impl="flash")
  with pytest.raises(ValueError, match="impl='explicit'"):
    plain(impl="fused", return_probs=True)


def _reference_shaped_attention(q, k, v, mask, resid_gain, skip_gain, centre_gain):
  """The textbook formula, differentiated by plain autodiff (no custom rule)."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
  probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
  C = attention.centering_matrix_from_mask(mask)
  eye = jnp.eye(q.shape[1], k.shape[1])
  g = lambda x: x[:, None, None]
  shaped = g(resid_gain) * probs + g(skip_gain) * eye - g(centre_gain) * C
  return jnp.einsum("bhqk,bkhd->bqhd", shaped, v), probs


@pytest.mark.parametrize("name", ["causal", "bidirectional_padded", "packed_causal"])
def test_explicit_gradients_equal_autodiff_of_the_formula_including_probs(name):
  """The explicit path's gradients, with a loss that also reads the returned softmax (as
  diagnostics or an attention-entropy penalty would). The speed package's hand-written JVP:
  tests/test_fast_attention.py, through the same check."""
  check_explicit_gradients_against_the_formula(attention.shaped_attention, name)


def check_explicit_gradients_against_the_formula(shaped_attention, name: str):
  """`shaped_attention(q, k, v, **gains, **case, return_probs=True)`'s gradients of q, k, v and
  the gains against plain autodiff of the textbook formula, in case `name` of CASES."""
  case = CASES[name]
  q, k, v = qkv()
  mask = masks.attention_mask(T, T, causal=case["causal"], key_mask=case.get("key_mask"),
                              segment_ids=case.get("segment_ids"))

  def read_out(out, probs):
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(3.0 * probs))

  def explicit_loss(q, k, v, gains):
    return read_out(*shaped_attention(q, k, v, **gains, **case, return_probs=True))

  def reference_loss(q, k, v, gains):
    return read_out(*_reference_shaped_attention(q, k, v, mask, **gains))

  got = jax.grad(explicit_loss, argnums=(0, 1, 2, 3))(q, k, v, GAINS)
  want = jax.grad(reference_loss, argnums=(0, 1, 2, 3))(q, k, v, GAINS)
  for g_got, g_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5)

"""The chunked cross-entropy equals the full-logits one in value and gradient, and the head's
vocabulary padding never changes a logit, a loss or a parameter count.

Tolerances (relative, over the whole array or the whole gradient tree; 10x that for each
weight array alone): float32 1e-5 for values and
gradients (only the order of summation differs); bfloat16 1e-2 for gradients (the chunked
logits are rounded to bfloat16, the full ones are not) and 1e-3 for the summed loss.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from conftest import TINY_MODEL
from simplified_flax.runs import config_checks
from simplified_flax.model import parameters
from simplified_flax.model.transformer import build_model
from simplified_flax.training import chunked_loss
from simplified_flax.training import losses
from simplified_flax.training import step

TOLERANCE = {"float32": {"loss": 1e-5, "grad": 1e-5}, "bfloat16": {"loss": 1e-3, "grad": 1e-2}}


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_size,pad_multiple", [(128, 1), (64, 8), (1000, 128)])
def test_cross_entropy_equals_full_logits(dtype, chunk_size, pad_multiple):
  N, D, V = 48, 32, 300
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  hidden_ND = jax.random.normal(keys[0], (N, D)).astype(dtype)
  table_VD = 0.3 * jax.random.normal(keys[1], (V, D))
  targets_N = jax.random.randint(keys[2], (N,), 0, V)
  weights_N = (jnp.arange(N) % 3 != 0).astype(jnp.float32)
  head = chunked_loss.HeadSpec.layout(V, chunk_size, pad_multiple, dtype)
  assert head.width % pad_multiple == 0 and (head.n_chunks - 1) * head.width < V

  def chunked(h, table):
    return jnp.sum(chunked_loss.cross_entropy_N(h, table, targets_N, head) * weights_N)

  def full(h, table):
    logits_NV = jnp.einsum("nd,vd->nv", h, table.astype(dtype),
                           preferred_element_type=jnp.float32)
    return jnp.sum(losses.cross_entropy_BT(logits_NV[None], targets_N[None])[0] * weights_N)

  got, got_grads = jax.jit(jax.value_and_grad(chunked, (0, 1)))(hidden_ND, table_VD)
  want, want_grads = jax.jit(jax.value_and_grad(full, (0, 1)))(hidden_ND, table_VD)
  assert _rel(got, want) < TOLERANCE[dtype]["loss"]
  for g, w in zip(got_grads, want_grads):
    assert g.dtype == w.dtype and _rel(g, w) < TOLERANCE[dtype]["grad"]
  stats = chunked_loss.chunk_statistics(hidden_ND, table_VD, targets_N, head, with_argmax=True)
  logits_NV = jnp.einsum("nd,vd->nv", hidden_ND, table_VD.astype(dtype),
                         preferred_element_type=dtype)
  np.testing.assert_array_equal(stats["argmax"], jnp.argmax(logits_NV, axis=-1))


def _config(variant, dtype, **model):
  tiny = {f"model.{key}": value
          for key, value in dict(TINY_MODEL, n_layer=1, vocab_size=300).items()}
  return configs.load(variant, {**tiny, **{f"model.{k}": v for k, v in model.items()},
                                "dtype": dtype, "batch_size": 4})


def _batch(kind, rng):
  tokens_BT = jnp.asarray(rng.integers(0, 300, size=(4, 16)), jnp.int32)
  if kind == "decoder":   # packed rows: two documents, padding at the end of one row
    segment_ids_BT = jnp.asarray(np.where(np.arange(16) < 7, 1, 2)[None].repeat(4, 0))
    return {"inputs": tokens_BT, "segment_ids": segment_ids_BT.at[0, 12:].set(0)}
  weights_BT = jnp.asarray(rng.random((4, 16)) < 0.25, jnp.float32)
  return {"inputs": tokens_BT, "targets": tokens_BT[:, ::-1], "weights": weights_BT}


@pytest.mark.parametrize("variant,dtype", [("sas_p", "float32"), ("sas_p", "bfloat16"),
                                           ("bert_sas_p", "float32")])
def test_training_and_evaluation_losses_equal_the_full_logits_loss(variant, dtype):
  """Decoder with packed segment weights, encoder with MLM weights: the step's loss sums, the
  gradient of every parameter and the encoder's exact-match count agree with the chunked
  loss off (model.loss_vocab_chunk_size=0). (bfloat16 arg-max ties: the first test.)"""
  results = {}
  for chunk in (128, 0):
    config = _config(variant, dtype, loss_vocab_chunk_size=chunk)
    state = step.create_train_state(config, jax.random.PRNGKey(0))
    assert (state.spec.head is None) == (chunk == 0)
    batch = _batch(config.model.kind, np.random.default_rng(0))
    loss_fn = lambda p, s=state: step._loss_sums(  # pylint: disable=protected-access
        s, p, batch, train=True, key=jax.random.PRNGKey(1))["loss_sum"]
    results[chunk] = (jax.jit(jax.grad(loss_fn))(state.params),
                      jax.jit(step.eval_step)(state, batch))
  (grads, sums), (want_grads, want_sums) = results[128], results[0]
  assert float(sums["weight_sum"]) == float(want_sums["weight_sum"]) > 0
  assert _rel(sums["loss_sum"], want_sums["loss_sum"]) < TOLERANCE[dtype]["loss"]
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert _rel(flat(grads), flat(want_grads)) < TOLERANCE[dtype]["grad"]
  for path, g in jax.tree_util.tree_leaves_with_path(grads):   # no weight is left behind
    want = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
    if g.size > 1:   # a scalar gain's gradient sums many cancelling terms: the tree check
      assert _rel(g, want) < 10 * TOLERANCE[dtype]["grad"], jax.tree_util.keystr(path)
  if variant.startswith("bert"):
    assert float(sums["correct_sum"]) == float(want_sums["correct_sum"])


def test_vocab_padding_changes_no_logit_and_no_parameter():
  config = _config("sas_p", "float32")
  padded = _config("sas_p", "float32", vocab_pad_multiple=128)
  tokens_BT = _batch("decoder", np.random.default_rng(1))["inputs"]
  variables = build_model(config.model).init(jax.random.PRNGKey(0), tokens_BT)
  padded_variables = build_model(padded.model).init(jax.random.PRNGKey(0), tokens_BT)
  assert parameters.counts(variables) == parameters.counts(padded_variables)
  want = build_model(config.model).apply(variables, tokens_BT)
  got = build_model(padded.model).apply(variables, tokens_BT)
  assert got.shape == want.shape == (4, 16, 300)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field,value", [("loss_vocab_chunk_size", -1),
                                         ("vocab_pad_multiple", 0)])
def test_bad_head_settings_are_one_clear_error(field, value):
  config = _config("preln", "float32", **{field: value})
  with pytest.raises(config_checks.ConfigError, match=f"model.{field}=") as err:
    config_checks.validate_model_config(config.model)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_and_recomputed_logits_give_the_same_loss_and_gradients(dtype):
  """`model.loss_keep_logits` trades memory for a head matmul, never a value beyond round-off
  (the kept path takes the vocabulary as one chunk, the recomputed path in chunks: the sums
  are ordered differently)."""
  N, D, V = 48, 32, 300
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  hidden_ND = jax.random.normal(keys[0], (N, D)).astype(dtype)
  table_VD = 0.3 * jax.random.normal(keys[1], (V, D))
  targets_N = jax.random.randint(keys[2], (N,), 0, V)
  weights_N = jnp.linspace(0.0, 1.0, N)
  results = []
  for keep in (True, False):
    head = chunked_loss.HeadSpec.layout(V, 128, 8, dtype, keep_logits=keep)
    loss = lambda h, table: jnp.sum(
        chunked_loss.cross_entropy_N(h, table, targets_N, head) * weights_N)
    results.append(jax.jit(jax.value_and_grad(loss, (0, 1)))(hidden_ND, table_VD))
  (kept_loss, kept_grads), (recomputed_loss, recomputed_grads) = results
  assert _rel(kept_loss, recomputed_loss) < 1e-6
  for kept, recomputed in zip(kept_grads, recomputed_grads):
    assert kept.dtype == recomputed.dtype
    assert _rel(kept, recomputed) < (1e-6 if dtype == "float32" else 1e-3)
  assert chunked_loss.HeadSpec.from_config(_config("preln", dtype).model, dtype).keep_logits
  config = _config("preln", dtype, loss_keep_logits=False)
  assert not chunked_loss.HeadSpec.from_config(config.model, dtype).keep_logits

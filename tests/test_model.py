"""Model behaviour users rely on: identity at init, causality, padding invariance, gains."""
import flax.linen as nn
import jax
import ml_collections
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import DECODER_VARIANTS, tiny_config
from simplified_flax.model import block
from simplified_flax.model import transformer as models

T, V = 16, 61
IMPLS = ("explicit", "fused")


def tokens(batch=2, length=T, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, V)


def init(config, toks):
  model = models.build_model(config.model)
  return model, model.init(jax.random.key(0), toks)


def next_token_loss(model, variables, params, toks):
  logits = model.apply({**variables, "params": params}, toks)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]).mean()


def _embedding_interceptor(delta_BTD):
  """Adds delta to the embedding (at the token lookup's output, which every model has: x =
  wte + wpe, or wte alone with rotary positions)."""
  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.name == "wte" and context.method_name == "__call__":
      return out + delta_BTD
    return out
  return intercept


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_decoder_is_causal_by_gradients(variant, impl):
  config = tiny_config(variant, attention_impl=impl)
  toks = tokens(batch=1)
  model, variables = init(config, toks)

  def logits_TV(delta_BTD):
    with nn.intercept_methods(_embedding_interceptor(delta_BTD)):
      return model.apply(variables, toks)[0]

  positions = (0, 7, T - 2)

  @jax.jit   # one program for every position: one forward pass, one vmapped backward pass
  def position_grads(delta_BTD):
    logits, vjp = jax.vjp(logits_TV, delta_BTD)
    # Row p's cotangent is 1 at position positions[p], every vocabulary entry, 0 elsewhere:
    # its VJP is the gradient of sum(logits[positions[p]]) with respect to the embeddings.
    ones_PTV = jnp.zeros((len(positions),) + logits.shape).at[
        jnp.arange(len(positions)), jnp.array(positions)].set(1.0)
    return jax.vmap(lambda ones_TV: vjp(ones_TV)[0][0])(ones_PTV)

  grads_PTD = position_grads(jnp.zeros((1, T, config.model.n_embd)))
  for t, grad_TD in zip(positions, grads_PTD):
    assert float(jnp.abs(grad_TD[t + 1:]).max()) == 0.0, f"position {t} sees the future"
    assert float(jnp.abs(grad_TD[: t + 1]).max()) > 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_encoder_outputs_at_real_tokens_ignore_appended_padding(impl):
  config = tiny_config("bert_sas_p", attention_impl=impl)
  toks = tokens(length=10)
  model, variables = init(config, toks)

  @jax.jit   # both passes in one program (op by op, each op compiled apart, was slower)
  def short_and_padded(variables):
    short = model.apply(variables, toks, key_mask=jnp.ones((2, 10), bool))
    padded_toks = jnp.concatenate([toks, jnp.zeros((2, 6), toks.dtype)], axis=1)
    key_mask = jnp.arange(16)[None, :] < 10
    return short, model.apply(variables, padded_toks,
                              key_mask=jnp.broadcast_to(key_mask, (2, 16)))

  short, padded = short_and_padded(variables)
  np.testing.assert_allclose(padded[:, :10], short, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_sas_attention_sub_block_is_the_identity_at_init(causal):
  config = tiny_config("sas")
  m = ml_collections.FrozenConfigDict(config.model)
  x_BTD = jax.random.normal(jax.random.key(3), (2, T, m.n_embd))
  key_mask = None if causal else jnp.arange(T)[None, :] < jnp.array([[11], [16]])
  for layer in (0, 1):   # layer 0 has a reparameterised value (W=0, W0=I); layer 1 none
    sub = block.AttentionSubBlock(m, layer, causal)
    anchors = {"value": jnp.eye(m.n_embd)} if layer == 0 else {}
    variables = sub.init(jax.random.key(0), x_BTD, anchors, key_mask=key_mask)
    out = sub.apply(variables, x_BTD, anchors, key_mask=key_mask)
    real = np.ones((2, T), bool) if causal else np.asarray(key_mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(x_BTD)[real], atol=1e-6)


def gain_paths(params):
  flat = traverse_util.flatten_dict(params, sep="/")
  return {k: v for k, v in flat.items() if k.endswith("_gain")}


@pytest.mark.parametrize("variant", DECODER_VARIANTS + ("bert_sas",))
def test_every_trainable_gain_learns_after_one_step(variant):
  config = tiny_config(variant)
  toks = tokens()
  model, variables = init(config, toks)
  loss_and_grads = jax.jit(jax.value_and_grad(
      lambda p: next_token_loss(model, variables, p, toks)))   # one compile, used twice
  params = variables["params"]
  # One Adam step from its fresh state: lr * sign(g) (its bias-corrected first step).
  params = jax.tree.map(lambda p, g: p - 1e-2 * jnp.sign(g), params, loss_and_grads(params)[1])
  loss, grads = loss_and_grads(params)
  assert np.isfinite(float(loss))
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  for path, g in gain_paths(grads).items():
    if config.model.parallel_layers and "/norm2/" in path:
      continue   # the parallel block's norm2 is created, unread (model/block.py): DyT's alpha
    assert float(jnp.abs(g).max()) > 0, f"{path} received no gradient"


def test_non_trainable_gains_are_not_parameters():
  assert gain_paths(init(tiny_config("preln"), tokens())[1]["params"]) == {}
  assert gain_paths(init(tiny_config("op"), tokens())[1]["params"]) == {}
  sas_p = gain_paths(init(tiny_config("sas_p"), tokens())[1]["params"])
  names = {p.split("/")[-1] for p in sas_p}
  assert names == {"attn_block_resid_gain", "mlp_block_resid_gain", "attn_mat_resid_gain",
                   "attn_mat_skip_gain", "centre_attn_gain", "resid_gain", "skip_gain"}
  assert not any("skip_gain" in p and "block" in p for p in sas_p)   # parallel skips: fixed


def test_sas_keeps_a_value_matrix_only_in_layer_zero_and_no_projection():
  params = init(tiny_config("sas", n_layer=3), tokens())[1]["params"]
  flat = traverse_util.flatten_dict(params, sep="/")
  assert "h_0/attn/value/kernel" in flat
  assert not any(k.startswith(("h_1/attn/value", "h_2/attn/value")) for k in flat)
  assert not any("/attn/proj/" in k for k in flat)


def test_tied_anchor_matrices():
  config = tiny_config("sas", n_layer=3, val_init_type="orth", value_resid_gain=1.0,
                       first_layer_value_resid_gain=None)
  config.model.tie_valproj_init = "all_blocks"
  anchors = init(config, tokens())[1]["constants"]["anchors"]
  for layer in range(3):
    a = anchors[f"layer_{layer}"]
    np.testing.assert_allclose(a["proj"], a["value"].T)
  config.model.tie_valproj_init = "last_block"
  anchors = init(config, tokens())[1]["constants"]["anchors"]
  product = jnp.eye(32)
  for layer in range(3):
    product = product @ anchors[f"layer_{layer}"]["value"] @ anchors[f"layer_{layer}"]["proj"]
  np.testing.assert_allclose(product, jnp.eye(32), atol=1e-4)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  config = tiny_config("sas_p")
  toks = tokens()
  model = models.build_model(config.model, dtype="bfloat16")
  variables = model.init(jax.random.key(0), toks)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables["params"]))
  logits = model.apply(variables, toks)
  assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
  ref = models.build_model(config.model).apply(variables, toks)
  np.testing.assert_allclose(logits, ref, atol=0.1)


def test_hidden_states_and_attention_probs_are_sown():
  config = tiny_config("sas")
  toks = tokens()
  model, variables = init(config, toks)
  _, state = model.apply(variables, toks, mutable=["intermediates"])
  inter = state["intermediates"]
  assert len(inter["hidden"]) == 2 and inter["hidden"][0].shape == (2, T, 32)
  assert inter["h_0"]["attn"]["attn_probs"][0].shape == (2, 4, T, T)


def test_packed_rows_equal_separate_sequences():
  config = tiny_config("sas", attention_impl="fused")
  a, b = tokens(1, 6, seed=4), tokens(1, 10, seed=5)
  model, variables = init(config, a)

  @jax.jit   # the three passes in one program (op by op, each op compiled apart, was slower)
  def packed_and_alone(variables):
    packed = model.apply(variables, jnp.concatenate([a, b], 1),
                         segment_ids=jnp.array([[1] * 6 + [2] * 10]))
    return packed, model.apply(variables, a), model.apply(variables, b)

  packed, alone_a, alone_b = packed_and_alone(variables)
  np.testing.assert_allclose(packed[:, :6], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[:, 6:], alone_b, atol=1e-5)


@pytest.mark.parametrize("variant", ["preln", "sas_p"])
def test_forward_mode_agrees_with_reverse_mode_so_hessian_vector_products_work(variant):
  """The speed-motivated custom JVPs (dense kernels, shaped softmax) support both modes:
  the directional derivative from jax.jvp equals <grad, v>, and forward-over-reverse
  Hessian-vector products run and agree with reverse-over-reverse."""
  config = tiny_config(variant)
  toks = tokens()
  model, variables = init(config, toks)
  loss_fn = lambda p: next_token_loss(model, variables, p, toks)
  params = variables["params"]
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  direction = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape)
                                           for k, x in zip(keys, leaves)])
  # Jitted, the four transformations in one program: one compile, not one per transformation
  # (nor op-by-op dispatch).
  @jax.jit
  def both_modes(p, v):
    forward = jax.jvp(loss_fn, (p,), (v,))[1]
    reverse = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(jax.grad(loss_fn)(p)),
                                                  jax.tree.leaves(v)))
    hvp_fwd_rev = jax.jvp(jax.grad(loss_fn), (p,), (v,))[1]
    hvp_rev_rev = jax.grad(lambda p, v: jnp.vdot(
        jax.flatten_util.ravel_pytree(jax.grad(loss_fn)(p))[0],
        jax.flatten_util.ravel_pytree(v)[0]))(p, v)
    return forward, reverse, hvp_fwd_rev, hvp_rev_rev

  forward, reverse, hvp_fwd_rev, hvp_rev_rev = both_modes(params, direction)
  np.testing.assert_allclose(forward, reverse, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(hvp_fwd_rev), jax.tree.leaves(hvp_rev_rev)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)

"""nGPT (model/ngpt.py) and CompleteP (model/block.py, training/optimizer.py) held to their
papers' formulas, computed by hand from the sub-modules and the parameters: nGPT's sphere,
its update, its logits and its renormalising optimiser; CompleteP's branch multiplier, its
Table 1 learning rates and eps at two depths, and Pre-LN exactly at the base depth."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import tiny_config
from simplified_flax.authors import config_map
from simplified_flax.model import block
from simplified_flax.model import ngpt
from simplified_flax.model import transformer
from simplified_flax.runs import config_checks
from simplified_flax.training import optimizer
from simplified_flax.training import step

T, V = 16, 61


def _tokens(batch=2, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, T), 0, V)


def _norms(x, axis=-1):
  return np.linalg.norm(np.asarray(x, np.float64), axis=axis)


def _perturbed(params, scale=0.3, seed=7):
  """Every learnable scale (`*_gain`) moved off its initial value, so that a formula that
  forgot one would not match."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [x * (1 + scale * jax.random.normal(k, x.shape))
         if optimizer.leaf_names(p)[-1].endswith("_gain") else x
         for (p, x), k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------------
# nGPT
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ngpt_model():
  """(config, variables with perturbed scales, {"logits", "hidden", "intermediates"}): one
  compile for the whole model."""
  config = tiny_config("ngpt", attention_impl="explicit")
  model = transformer.build_model(config.model)

  def run(key, tokens_BT):
    variables = model.init(key, tokens_BT)
    variables = {**variables, "params": _perturbed(variables["params"])}
    hidden_BTD, state = model.apply(variables, tokens_BT, return_hidden=True,
                                    mutable=["intermediates"])
    return variables, {"logits": model.apply(variables, tokens_BT), "hidden": hidden_BTD,
                       "intermediates": state["intermediates"]}
  variables, outputs = jax.jit(run)(jax.random.key(0), _tokens())
  return config, variables, outputs


def test_ngpt_hidden_states_stay_on_the_unit_sphere(ngpt_model):
  _, _, outputs = ngpt_model
  hidden_BTD, blocks = outputs["hidden"], outputs["intermediates"]["hidden"]
  assert len(blocks) == 2
  for h_BTD in (*blocks, hidden_BTD):   # no final norm: the last block's output is the head's
    np.testing.assert_allclose(_norms(h_BTD), 1.0, atol=1e-5)
  np.testing.assert_array_equal(hidden_BTD, blocks[-1])


def _rotated(x_BTHd, theta):
  """RoFormer's rotation of adjacent pairs by position * theta^(-2i/d), by hand."""
  d = x_BTHd.shape[-1]
  angle_Tf = np.arange(x_BTHd.shape[1])[:, None] * theta ** (-np.arange(0, d, 2) / d)
  cos, sin = np.cos(angle_Tf)[:, None], np.sin(angle_Tf)[:, None]
  even, odd = x_BTHd[..., 0::2], x_BTHd[..., 1::2]
  return np.stack([even * cos - odd * sin, even * sin + odd * cos], -1).reshape(x_BTHd.shape)


def test_ngpt_layer_is_the_normalised_update_of_its_branches(ngpt_model):
  """h1 = Norm(h + alpha_A (Norm(Attn(h)) - h)), h2 = Norm(h1 + alpha_M (Norm(MLP(h1)) - h1)),
  alpha = stored * (0.05 / D^-1/2); the branches from the formulas of the paper too, with
  rotary positions on q and k before their normalisation, as the authors' code has them."""
  config, variables, _ = ngpt_model
  m = ml_collections.FrozenConfigDict(config.model)
  assert m.position_embedding == "rope" and not m.tie_head
  D, H, F = m.n_embd, m.n_head, m.mlp_width_mult * m.n_embd
  d = D // H
  p = variables["params"]["h_0"]
  h_BTD = np.asarray(ngpt.unit_norm(jax.random.normal(jax.random.key(3), (2, T, D))))
  out_BTD = jax.jit(lambda p, h: ngpt.Block(m, 0, True).apply({"params": p}, h, {}))(p, h_BTD)

  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  a = {"/".join(optimizer.leaf_names(path)): np.asarray(leaf, np.float64)
       for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]}

  def attn_by_hand(h):
    q, k, v = (h @ a[f"attn/{n}/kernel"] for n in ("query", "key", "value"))
    s_qk = (a["attn/sqk_gain"] * (1.0 / D ** -0.5)).reshape(H, d)
    split = lambda x: x.reshape(2, T, H, d)
    q, k, v = split(q), split(k), split(v)
    q, k = _rotated(q, m.rope_theta), _rotated(k, m.rope_theta)   # the authors' order: first
    q, k = s_qk * unit(q), s_qk * unit(k)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * np.sqrt(d)   # sqrt(d_k), not 1/sqrt(d_k)
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(2, T, D) @ a["attn/proj/kernel"]

  def mlp_by_hand(h):
    uv = h @ a["mlp/c_fc/kernel"]
    u, v = uv[..., :F] * a["mlp/su_gain"], uv[..., F:] * a["mlp/sv_gain"] * np.sqrt(D)
    return (u * v / (1 + np.exp(-v))) @ a["mlp/c_proj/kernel"]

  h = np.asarray(h_BTD, np.float64)
  for kind, branch in (("attn", attn_by_hand), ("mlp", mlp_by_hand)):
    alpha = a[f"{kind}_alpha_gain"] * (ngpt.ALPHA_INIT / D ** -0.5)
    h = unit(h + alpha * (unit(branch(h)) - h))
  np.testing.assert_allclose(out_BTD, h, atol=2e-5)
  np.testing.assert_allclose(_norms(out_BTD), 1.0, atol=1e-5)


def test_ngpt_logits_are_s_z_times_h_e_transposed(ngpt_model):
  config, variables, outputs = ngpt_model
  params = variables["params"]
  s_z = np.asarray(params["sz_gain"]) * (ngpt.SZ_INIT / config.model.n_embd ** -0.5)
  table_VD = np.asarray(params["lm_head"]["embedding"])   # a head of its own, as the authors'
  assert "wpe" not in params   # rotary positions: no table
  h_BTD = np.asarray(outputs["hidden"])
  np.testing.assert_allclose(outputs["logits"], s_z * (h_BTD @ table_VD.T), atol=1e-5)


def _on_the_sphere(params):
  """Every weight matrix and table unit-norm along its embedding axis (model/ngpt.py)."""
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    axis = ngpt.embedding_axis(optimizer.leaf_names(path))
    if axis is not None:
      np.testing.assert_allclose(_norms(leaf, axis), 1.0, atol=2e-6,
                                 err_msg=jax.tree_util.keystr(path))
      checked += 1
  return checked


def test_ngpt_trains_with_every_matrix_renormalised_after_each_step():
  config = tiny_config("ngpt")
  o = config.optimizer
  assert o.weight_decay == 0 and o.warmup_steps == 0 and o.name == "adamw"
  config.num_train_steps = 2
  schedule = optimizer.make_schedule(o, config.num_train_steps)
  assert float(schedule(0)) == np.float32(o.learning_rate)   # no warm-up: the peak at once
  state = step.create_train_state(config, jax.random.PRNGKey(0))
  # Every scale stored as s_scale * ones (so s_init at first): s_z, alpha, s_qk at 1/sqrt(D).
  D = config.model.n_embd
  for scale in (state.params["sz_gain"], state.params["h_1"]["mlp_alpha_gain"],
                state.params["h_0"]["attn"]["sqk_gain"]):
    np.testing.assert_allclose(scale, D ** -0.5, rtol=1e-6)
  np.testing.assert_array_equal(state.params["h_0"]["mlp"]["sv_gain"], 1.0)
  # 2 layers x (query, key, value, proj, c_fc, c_proj) + wte + lm_head (rotary: no wpe)
  assert _on_the_sphere(state.params) == 14
  before = state.params
  train = jax.jit(step.train_step)
  losses = []
  for _ in range(2):
    state, metrics = train(state, {"inputs": _tokens()})
    losses.append(float(metrics["loss"]))
    assert _on_the_sphere(state.params) == 14
  assert np.isfinite(losses).all() and losses[1] < losses[0]
  moved = state.params["h_0"]["mlp"]["c_fc"]["kernel"]
  assert not np.allclose(moved, before["h_0"]["mlp"]["c_fc"]["kernel"])
  # The learnable scales are trained, not projected (s_z is not a unit vector).
  assert abs(_norms(state.params["sz_gain"]) - 1.0) > 1e-3


def test_ngpt_renormalisation_is_the_optimisers_and_knows_every_matrix():
  config = tiny_config("ngpt")
  params = {"h_0": {"attn": {"query": {"kernel": jnp.full((4, 4), 3.0)}, "sqk_gain": jnp.ones(4)},
                    "mlp": {"c_proj": {"kernel": jnp.full((8, 4), 2.0)}}},
            "wte": {"embedding": jnp.full((5, 4), 2.0)}}
  tx = optimizer.make_optimizer(config)
  new = jax.jit(lambda p: optax.apply_updates(
      p, tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0]))(params)
  np.testing.assert_allclose(new["h_0"]["attn"]["query"]["kernel"], 0.5, rtol=1e-6)   # columns
  np.testing.assert_allclose(new["h_0"]["mlp"]["c_proj"]["kernel"], 0.5, rtol=1e-6)   # rows
  np.testing.assert_allclose(new["wte"]["embedding"], 0.5, rtol=1e-6)
  np.testing.assert_array_equal(new["h_0"]["attn"]["sqk_gain"], 1.0)
  with pytest.raises(ValueError, match="h_0/attn/gate/kernel.*EMBEDDING_AXIS"):
    ngpt.renormalize({"h_0": {"attn": {"gate": {"kernel": jnp.ones((4, 4))}}}})


# ------------------------------------------------------------------------------------------
# CompleteP
# ------------------------------------------------------------------------------------------
def _depth_mup(n_layer, alpha=1.0, base=4):
  return ml_collections.ConfigDict({"n_layer": n_layer, "depth_mup_alpha": alpha,
                                    "depth_mup_base_layers": base})


@pytest.mark.parametrize("n_layer,alpha,multiplier", [
    (4, 1.0, 1.0), (16, 1.0, 0.25), (2, 1.0, 2.0), (16, 0.5, 0.5), (4, None, 1.0)])
def test_completep_branch_multiplier_is_base_over_depth_to_the_alpha(n_layer, alpha, multiplier):
  assert block.depth_branch_multiplier(_depth_mup(n_layer, alpha)) == multiplier


def test_completep_block_scales_each_branch_by_its_multiplier():
  """x1 = x + m_L^-alpha Attn(norm1(x)), out = x1 + m_L^-alpha MLP(norm2(x1)) at L = 16,
  L_base = 4 (m_L^-alpha = 1/4), the branch outputs recorded as the block computes them."""
  config = tiny_config("completep", n_layer=16)
  m = ml_collections.FrozenConfigDict(config.model)
  x_BTD = jax.random.normal(jax.random.key(2), (2, T, m.n_embd))
  layer = block.Block(m, 3, True)

  def run(key, x_BTD):
    seen = {}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.method_name == "__call__" and context.module.name in ("attn", "mlp"):
        seen[context.module.name] = out
      return out
    variables = layer.init(key, x_BTD, {})
    with nn.intercept_methods(record):
      return layer.apply(variables, x_BTD, {}), seen
  out_BTD, seen = jax.jit(run)(jax.random.key(0), x_BTD)
  x1_BTD = x_BTD + 0.25 * seen["attn"]
  np.testing.assert_allclose(out_BTD, x1_BTD + 0.25 * seen["mlp"], atol=1e-6)


@pytest.mark.parametrize("n_layer,alpha,lr_scale,eps_scale", [
    (4, 1.0, 1.0, 1.0), (16, 1.0, 1.0, 0.25), (16, 0.5, 0.5, 0.5), (2, 1.0, 1.0, 2.0)])
def test_completep_optimizer_follows_table_1(n_layer, alpha, lr_scale, eps_scale):
  """Table 1 (depth terms): blocks' LR eta m_L^(alpha-1), embeddings and the final norm at the
  base one; AdamW's eps m_L^-alpha in every group (the authors' code). Adam's first step is
  lr * g / (|g| + eps): with |g| = eps_base both scales show in the update."""
  assert optimizer.depth_mup_scales(_depth_mup(n_layer, alpha)) == (lr_scale, eps_scale)
  config = tiny_config("completep", n_layer=n_layer)
  config.model.depth_mup_alpha = alpha
  config.optimizer.weight_decay, config.optimizer.warmup_steps = 0.0, 0   # lr at its peak
  lr, eps = config.optimizer.learning_rate, config.optimizer.eps
  params = {"h_0": {"attn": {"c_attn": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}},
                    "norm1": {"scale": jnp.ones(2)}},
            "h_1_to_3": {"mlp": {"c_fc": {"kernel": jnp.ones((3, 2, 2))}}},
            "wte": {"embedding": jnp.ones((3, 2))}, "ln_f": {"scale": jnp.ones(2)}}
  grads = jax.tree.map(lambda p: jnp.full_like(p, eps), params)
  tx = optimizer.make_optimizer(config)
  updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
  for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
    in_block = optimizer.in_residual_block(optimizer.leaf_names(path))
    lr_g, eps_g = (lr * lr_scale if in_block else lr), eps * eps_scale
    np.testing.assert_allclose(u, -lr_g * eps / (eps + eps_g), rtol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_completep_initialises_as_pre_ln_at_every_depth():
  """Table 1's depth terms leave every initial variance alone: Pre-LN's values at 4 and 16
  layers, N(0, 0.02) (no 1/sqrt(2L) rescaling) and norm scales 1. Scanned layers: one block
  compiled per depth."""
  for n_layer in (4, 16):
    inits = []
    for name in ("completep", "preln"):
      model = transformer.build_model(tiny_config(name, n_layer=n_layer, scan_layers=True).model)
      inits.append(jax.jit(lambda k, m=model: m.init(k, _tokens(1))["params"])(
          jax.random.key(0)))
    assert all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, inits)))
    stack = inits[0][f"h_0_to_{n_layer - 1}"]
    kernels = np.concatenate([np.ravel(stack[sub][name]["kernel"]) for sub, name in (
        ("attn", "c_attn"), ("mlp", "c_fc"), ("mlp", "c_proj"))])
    assert abs(kernels.std() - 0.02) < 0.0005, (n_layer, kernels.std())
    np.testing.assert_array_equal(stack["norm2"]["scale"], 1.0)


def test_completep_at_its_base_depth_is_pre_ln_exactly():
  """L = L_base: the same parameters give the same loss, bit for bit, and the optimiser the
  same update (two parameter groups, both at the base learning rate and eps)."""
  completep = tiny_config("completep", depth_mup_base_layers=2)   # L = L_base = 2
  preln = tiny_config("preln")
  models = [transformer.build_model(c.model) for c in (completep, preln)]
  toks = _tokens()
  variables = jax.jit(models[1].init)(jax.random.key(0), toks)

  def loss(model, params):
    logits = model.apply({**variables, "params": params}, toks)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]).mean()

  def run(params):   # (loss, grads, the optimiser's update) of each, in one program
    out = []
    for model, config in zip(models, (completep, preln)):
      value, grads = jax.value_and_grad(lambda q, m=model: loss(m, q))(params)
      tx = optimizer.make_optimizer(config)
      out.append((value, grads, tx.update(grads, tx.init(params), params)[0]))
    return out
  (loss_c, grads_c, update_c), (loss_p, grads_p, update_p) = jax.jit(run)(variables["params"])
  assert float(loss_c) == float(loss_p)
  for mine, pre_ln in ((grads_c, grads_p), (update_c, update_p)):
    assert all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, (mine, pre_ln))))


def test_completep_trains_a_couple_of_steps():
  config = tiny_config("completep")   # L = 2 < L_base = 4: branches doubled
  config.num_train_steps = 2
  state = step.create_train_state(config, jax.random.PRNGKey(0))
  train = jax.jit(step.train_step)
  losses = []
  for _ in range(2):
    state, metrics = train(state, {"inputs": _tokens()})
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and losses[1] < losses[0]


# ------------------------------------------------------------------------------------------
# Config checks and conversion
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,overrides,message", [
    ("ngpt", {"model.kind": "encoder"},
     r"model.ngpt=True is nGPT's decoder; model.kind='encoder'"),
    ("ngpt", {"model.parallel_layers": True, "model.attn_block_skip_gain": 0.0},
     r"model.parallel_layers=True has no nGPT form"),
    ("ngpt", {"model.depth_mup_alpha": 1.0}, r"model.depth_mup_alpha=1.0 scales residual"),
    ("completep", {"model.depth_mup_alpha": 2.0},
     r"model.depth_mup_alpha=2.0 must be a number in \[0.5, 1\]"),
    ("completep", {"model.depth_mup_base_layers": None},
     r"model.depth_mup_base_layers=None must be an integer >= 1: the depth L_base"),
    ("completep", {"optimizer.name": "muon"},
     r"optimizer.name='muon' with model.depth_mup_alpha=1.0: .*use optimizer.name='adamw'"),
])
def test_bad_ngpt_and_completep_values_name_the_field_and_fix(name, overrides, message):
  config = tiny_config(name)
  config.update_from_flattened_dict(overrides)
  with pytest.raises(config_checks.ConfigError, match=message) as error:
    config_checks.validate_run_config(config)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("name,match", [
    ("ngpt", "model.ngpt=True: the authors' code has no nGPT"),
    ("completep", "model.depth_mup_alpha=1.0: the authors' code has no CompleteP")])
def test_their_code_cannot_express_ngpt_or_completep(name, match):
  with pytest.raises(config_map.ConversionError, match=match) as error:
    config_map.authors_config(tiny_config(name).model)
  assert "\n" not in str(error.value)

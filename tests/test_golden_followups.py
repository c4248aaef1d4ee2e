"""The follow-up variants held to their authors' code: each golden file of tests/golden/ (made
by experiments/make_golden_files.py from the authors' repository at a named commit; its
README says which) is loaded into this project's module, which must give the authors'
outputs and gradients to float32 round-off. No torch: the files are the facts.

Tolerance (`assert_close`): rtol 1e-5 and atol 1e-6 times the largest |entry| of the expected
array, for values, gradients and optimiser steps alike (measured: at most 1.0e-6 of that
largest entry, nGPT's parameter gradients; the others 1e-7 to 1e-6). The named discrepancies
(docs/beyond_the_paper.md, "Held to the authors' code") are asserted as what they are:
  nGPT: their block re-normalises its input h inside the update (`justnorm(h)`), this
    project's does not, so the input-gradients agree in the tangent space at h (compared
    there) and differ in the radial component; their first hidden state is the raw token row
    E[token], this project's Norm(E[token] + P[position]), so the token table's gradient agrees
    once theirs is projected, row by row, onto the tangent space of the row.
  Gated attention: their v_proj and o_proj biases (qkv_bias puts one on every projection) are
    0 in the file: this project's value and output projections have none.
  CompleteP: only the parameters this project's Pre-LN has are compared (no LayerNorm biases
    in the blocks, no biases on value, proj and the MLP); every one of their groups is checked
    against this project's rules by name.
"""
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import load_config
from simplified_flax.model import block
from simplified_flax.model import layers
from simplified_flax.model import ngpt
from simplified_flax.model import transformer
from simplified_flax.training import optimizer

GOLDEN = pathlib.Path(__file__).parent / "golden"
RTOL, ATOL = 1e-5, 1e-6   # atol relative to the largest |entry| of the expected array


def golden(name: str) -> dict:
  with np.load(GOLDEN / f"{name}.npz") as z:
    return dict(z)


def prefixed(g: dict, prefix: str) -> dict:
  """The arrays of `g` whose key starts with `prefix`, by the rest of the key."""
  return {k[len(prefix):]: v for k, v in g.items() if k.startswith(prefix)}


def assert_close(actual, expected, what: str):
  expected = np.asarray(expected, np.float64)
  scale = float(np.abs(expected).max()) or 1.0
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL,
                             atol=ATOL * scale, err_msg=what)


def assert_trees_close(actual, expected, what: str):
  flat_actual = dict(jax.tree_util.tree_flatten_with_path(actual)[0])
  flat_expected = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert set(flat_actual) == {p for p, _ in flat_expected}, what
  for path, x in flat_expected:
    assert_close(flat_actual[path], x, f"{what} {jax.tree_util.keystr(path)}")


def assert_same_structure(params, module_init, *args):
  """`params` holds exactly the parameters (names and shapes) the module creates."""
  shapes = jax.eval_shape(module_init, jax.random.key(0), *args)["params"]
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda s: s.shape, shapes)


def value_and_grads(module, params, x, cotangent, *rest):
  """(out, d sum(out * cotangent) / d params, ... / d x) of `module(x, *rest)`, in one jitted
  program."""
  def loss(params, x):
    out = module.apply({"params": params}, x, *rest)
    return jnp.sum(out * cotangent), out
  (_, out), (grad_params, grad_x) = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grad_params, grad_x


def model_config(name: str, **model):
  config = load_config(name)
  config.model.update(model)
  return ml_collections.FrozenConfigDict(config.model)


# ------------------------------------------------------------------------------------------
# DyT (jiachenzhu/DyT) and Derf (zlab-princeton/Derf)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dyt", "dyt_llama", "derf"])
def test_dyt_and_derf_match_the_authors_modules(name):
  """layers.DyT = their DynamicTanh (dynamic_tanh.py: weight * tanh(alpha x) + bias) and
  LLaMA's LayerNormParameterized (weight * tanh(alpha x): the bias here 0); layers.Derf = their
  Dynamic_erf (weight * erf(alpha x + shift) + bias): the output and the gradients of x,
  alpha, shift, gamma and beta."""
  g = golden(name)
  D = g["input/x"].shape[-1]
  theirs = {"alpha_gain": "alpha", "shift_gain": "shift", "scale": "weight", "bias": "bias"}
  params = {ours: g[f"param/{t}"].reshape(() if ours.endswith("_gain") else (D,))
            for ours, t in theirs.items() if f"param/{t}" in g}
  if name == "dyt_llama":   # no bias in their LLaMA norm
    params["bias"] = np.zeros(D, np.float32)
  module = layers.Derf() if name == "derf" else layers.DyT()
  out, grads, grad_x = value_and_grads(module, params, g["input/x"], g["cotangent"])
  assert_close(out, g["out"], "out")
  assert_close(grad_x, g["grad/input/x"], "d/dx")
  for ours, t in theirs.items():
    if f"grad/param/{t}" in g:
      assert_close(grads[ours], g[f"grad/param/{t}"].reshape(params[ours].shape), ours)


# ------------------------------------------------------------------------------------------
# Gated attention (qiuzh20/gated_attention)
# ------------------------------------------------------------------------------------------
def gated_attention_params(t: dict, H: int) -> dict:
  """This project's attention sub-block parameters from their Qwen3Attention's (or their
  gradients: the map is linear). Their q_proj [2D, D] holds, per head, d query rows then d
  gate rows (their forward views its output [B, T, H, 2d] and splits each head's 2d);
  torch's Linear weights are [out, in], a kernel is [in, out]."""
  D = t["k_proj.weight"].shape[1]
  d = D // H
  qg_H2dD = t["q_proj.weight"].reshape(H, 2, d, D)
  qg_H2d = t["q_proj.bias"].reshape(H, 2, d)
  q_DD, gate_DD = (qg_H2dD[:, i].reshape(D, D) for i in (0, 1))
  return {"c_attn": {"kernel": np.concatenate([q_DD.T, t["k_proj.weight"].T], axis=1),
                     "bias": np.concatenate([qg_H2d[:, 0].reshape(D), t["k_proj.bias"]])},
          "gate": {"kernel": gate_DD.T, "bias": qg_H2d[:, 1].reshape(D)},
          "value": {"linear": {"kernel": t["v_proj.weight"].T}},
          "proj": {"linear": {"kernel": t["o_proj.weight"].T}}}


def test_gated_attention_matches_their_qwen3_attention():
  """Pre-LN's attention sub-block with `attn_output_gate` = their Qwen3Attention with the
  elementwise gate (eager, causal, no q/k norm, RoPE the identity): o_proj(SDPA(q, k, v) *
  sigmoid(gate)), the gate the second half of each head's q_proj output, with its bias. The
  output and the gradients of the input and of every mapped weight and bias."""
  g = golden("gated_attention")
  assert not g["param/v_proj.bias"].any() and not g["param/o_proj.bias"].any()
  x_BTD = g["input/hidden_states"]
  D, H = x_BTD.shape[-1], 2
  m = model_config("preln_gated", n_embd=D, n_head=H, attention_impl="explicit")
  sub = block.AttentionSubBlock(m, layer=0, causal=True)
  params = gated_attention_params(prefixed(g, "param/"), H)
  assert_same_structure(params, sub.init, x_BTD, {})
  out, grads, grad_x = value_and_grads(sub, params, x_BTD, g["cotangent"], {})
  assert_close(out, g["out"], "out")
  assert_close(grad_x, g["grad/input/hidden_states"], "d/dx")
  assert_trees_close(grads, gated_attention_params(prefixed(g, "grad/param/"), H), "d/dparams")


# ------------------------------------------------------------------------------------------
# nGPT (NVIDIA/ngpt)
# ------------------------------------------------------------------------------------------
def ngpt_block_params(t: dict, prefix: str = "") -> dict:
  """This project's nGPT layer parameters from their Block's (or their gradients). The
  stored scales carry over as they are (the same init values and scalings: alpha 0.05 and
  s_qk 1 at 1/sqrt(D), s_u and s_v 1 at 1); their suv [2F] is s_u then s_v. Their s_u is read
  times sqrt(D) as s_v is (the paper: s_v only): a factor on the MLP's output, which the
  update normalises away, so the stored values mean the same in both."""
  w = lambda name: t[f"{prefix}{name}.weight"].T
  F = t[f"{prefix}suv"].shape[0] // 2
  return {"attn": {"query": {"kernel": w("query")}, "key": {"kernel": w("key")},
                   "value": {"kernel": w("value")}, "proj": {"kernel": w("att_c_proj")},
                   "sqk_gain": t[f"{prefix}sqk"]},
          "mlp": {"c_fc": {"kernel": w("c_fc")}, "c_proj": {"kernel": w("mlp_c_proj")},
                  "su_gain": t[f"{prefix}suv"][:F], "sv_gain": t[f"{prefix}suv"][F:]},
          "attn_alpha_gain": t[f"{prefix}attn_alpha"], "mlp_alpha_gain": t[f"{prefix}mlp_alpha"]}


def tangent(g_BTD, h_BTD):
  """g projected onto the tangent space of the unit sphere at each row of h."""
  return g_BTD - h_BTD * np.sum(g_BTD * h_BTD, axis=-1, keepdims=True)


def test_ngpt_block_matches_their_block():
  """ngpt.Block = their Block (use_nGPT=1; RoPE left out, flash attention as SDPA, float32):
  h <- Norm(h + alpha_A (Norm(Attn(h)) - h)), then the same with alpha_M and the SwiGLU MLP,
  q and k per head normalised times s_qk, softmax scale sqrt(d). The output, the gradients of
  every parameter, and the input-gradient in the tangent space at h (their block normalises
  h again inside the update; the radial part differs, see the module docstring)."""
  g = golden("ngpt_block")
  h_BTD = g["input/h"]
  D = h_BTD.shape[-1]
  # Their RoPE is the identity in the file: the block without rotary positions.
  m = model_config("ngpt", n_embd=D, n_head=2, attention_impl="explicit",
                   position_embedding="learned")
  layer = ngpt.Block(m, layer=0, causal=True)
  params = ngpt_block_params(prefixed(g, "param/"))
  assert_same_structure(params, layer.init, h_BTD, {})
  out, grads, grad_h = value_and_grads(layer, params, h_BTD, g["cotangent"], {})
  assert_close(out, g["out"], "out")
  assert_trees_close(grads, ngpt_block_params(prefixed(g, "grad/param/")), "d/dparams")
  assert_close(tangent(np.asarray(grad_h), h_BTD), tangent(g["grad/input/h"], h_BTD),
               "d/dh, tangent part")


def test_ngpt_model_logits_and_loss_match_their_gpt():
  """The one-layer nGPT model = their GPT (the same stand-ins), positions zero here and the
  head's table their lm_head (equal to their wte in the file: this project ties them):
  logits s_z * (h E^T) with s_z stored at scale 1/sqrt(D), the mean cross-entropy, and the
  gradients of s_z, of the layer, and of the token table (theirs from the input projected
  row by row onto the tangent space of the row, plus their head's)."""
  g = golden("ngpt_model")
  wte_VD = g["param/transformer.wte.weight"]
  np.testing.assert_array_equal(g["param/lm_head.weight"], wte_VD)
  idx_BT, targets_BT = g["input/idx"], g["input/targets"]
  (V, D), T = wte_VD.shape, idx_BT.shape[1]
  config = load_config("ngpt")
  # Their RoPE is the identity in the file and their head equals their wte: this project's
  # nGPT with a zero position table and the tied head (configs/ngpt.py has rotary positions,
  # held to RoFormer's formula in tests/test_ngpt_completep.py, and a head of its own).
  config.model.update(n_layer=1, n_embd=D, n_head=2, vocab_size=V, context_length=T,
                      max_position_embeddings=T, attention_impl="explicit",
                      position_embedding="learned", tie_head=True)
  model = transformer.build_model(config.model)

  def tree(t):   # theirs (values or gradients) -> this project's parameters, wpe zero
    return {"wte": {"embedding": t["transformer.wte.weight"]},
            "wpe": {"embedding": np.zeros((T, D), np.float32)}, "sz_gain": t["sz"],
            "h_0": ngpt_block_params(t, "transformer.h.0.")}
  params = tree(prefixed(g, "param/"))
  assert_same_structure(params, model.init, idx_BT)

  def loss(params):
    logits_BTV = model.apply({"params": params, "constants": {"anchors": {}}}, idx_BT)
    logp_BTV = jax.nn.log_softmax(logits_BTV)
    return -jnp.mean(jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)), logits_BTV
  (loss_value, logits_BTV), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  assert_close(logits_BTV, g["logits"], "logits")
  assert_close(loss_value, g["loss"], "loss")
  expected = tree(prefixed(g, "grad/param/"))
  expected["wte"]["embedding"] = (tangent(g["grad/param/transformer.wte.weight"], wte_VD)
                                  + g["grad/param/lm_head.weight"])
  del grads["wpe"], expected["wpe"]   # theirs has no position table
  assert_trees_close(grads, expected, "d/dparams")


# ------------------------------------------------------------------------------------------
# CompleteP (EleutherAI/nanoGPT-mup, branch completep)
# ------------------------------------------------------------------------------------------
def unpack(g: dict) -> dict:
  """{moment: {their parameter name: array}} for param0, grad1, param1, grad2, param2."""
  shapes = [tuple(int(n) for n in s.split("x")) for s in g["shapes"]]
  sizes = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
  return {moment: {n: x.reshape(s) for n, s, x in zip(g["names"], shapes,
                                                       np.split(g[moment], sizes))}
          for moment in ("param0", "grad1", "param1", "grad2", "param2")}


def completep_params(t: dict, n_layer: int) -> dict:
  """This project's Pre-LN parameters from their nanoGPT's: c_attn [3D, D] is q, k (our
  c_attn, kernel [D, 2D]) then v (our value); their biases of v, c_proj, the MLP and the
  blocks' LayerNorms have no counterpart here (RMSNorm, bias-free projections)."""
  D = t["transformer.wte.weight"].shape[1]
  params = {"wte": {"embedding": t["transformer.wte.weight"]},
            "wpe": {"embedding": t["transformer.wpe.weight"]},
            "ln_f": {"scale": t["transformer.ln_f.weight"], "bias": t["transformer.ln_f.bias"]}}
  for l in range(n_layer):
    w = lambda name: t[f"transformer.h.{l}.{name}"]
    params[f"h_{l}"] = {
        "norm1": {"scale": w("ln_1.weight")}, "norm2": {"scale": w("ln_2.weight")},
        "attn": {"c_attn": {"kernel": w("attn.c_attn.weight")[:2 * D].T,
                            "bias": w("attn.c_attn.bias")[:2 * D]},
                 "value": {"linear": {"kernel": w("attn.c_attn.weight")[2 * D:].T}},
                 "proj": {"linear": {"kernel": w("attn.c_proj.weight").T}}},
        "mlp": {"c_fc": {"kernel": w("mlp.c_fc.weight").T},
                "c_proj": {"kernel": w("mlp.c_proj.weight").T}}}
  return params


def completep_config(g: dict):
  """configs/completep.py at the golden file's depth, m_L, alpha and AdamW settings, with a
  constant learning rate and no clipping (their train.py clips outside the optimiser)."""
  config = load_config("completep")
  tables = unpack(g)["param0"]
  (V, D), T = tables["transformer.wte.weight"].shape, tables["transformer.wpe.weight"].shape[0]
  n_layer = int(g["hyper/n_layer"])
  base_layers = n_layer / float(g["hyper/depth_multiplier"])   # their m_L = L / L_base here
  assert base_layers == int(base_layers)
  config.model.update(n_layer=n_layer, n_embd=D, n_head=1, vocab_size=V, context_length=T,
                      max_position_embeddings=T, depth_mup_alpha=float(g["hyper/alpha"]),
                      depth_mup_base_layers=int(base_layers))
  o = config.optimizer
  hyper = lambda key: float(g[f"hyper/{key}"])
  o.learning_rate, o.weight_decay = hyper("learning_rate"), hyper("weight_decay")
  o.b1, o.b2, o.eps = hyper("beta1"), hyper("beta2"), hyper("adam_eps")
  o.schedule, o.warmup_steps, o.grad_clip_norm = "constant", 0, 0.0
  return config


def project_path(name: str) -> tuple[str, ...]:
  """Their parameter name as this project's path (for the rules; RMSNorm and bias-free
  projections here, so some of these paths are not in this project's tree)."""
  parts = name.split(".")[1:]   # without "transformer"
  if parts[0] in ("wte", "wpe"):
    return (parts[0], "embedding")
  norm = {"ln_1": "norm1", "ln_2": "norm2", "ln_f": "ln_f"}.get(parts[-2])
  leaf = ("scale" if norm else "kernel") if parts[-1] == "weight" else "bias"
  head = (f"h_{parts[1]}",) if parts[0] == "h" else ()
  return head + ((norm,) if norm else tuple(parts[2:-1] if head else parts[:-1])) + (leaf,)


@pytest.mark.parametrize("name", ["completep_alpha10", "completep_alpha05"])
def test_completep_groups_are_the_projects_rules(name):
  """Each of their parameter groups (lr_scale, weight_decay, eps) is what this project gives
  a parameter of that name: the blocks' learning rate m_L^(alpha-1), eps m_L^-alpha in every
  group, decay on matrices and tables only (their biases and norms included)."""
  g = golden(name)
  config = completep_config(g)
  lr_scale, eps_scale = optimizer.depth_mup_scales(config.model)
  o = config.optimizer
  for their_name, (their_lr, their_wd, their_eps) in zip(g["names"], g["group"]):
    path = project_path(their_name)
    ours = (lr_scale if optimizer.in_residual_block(path) else 1.0,
            o.weight_decay if optimizer.leaf_gets_decay(path) else 0.0, o.eps * eps_scale)
    np.testing.assert_allclose(ours, (their_lr, their_wd, their_eps), rtol=1e-6,
                               err_msg=f"{their_name} -> {'/'.join(path)}")


@pytest.mark.parametrize("name", ["completep_alpha10", "completep_alpha05"])
def test_completep_adamw_steps_match_their_optimizer(name):
  """make_optimizer(configs/completep.py) = their torch AdamW with their CompleteP groups:
  two steps on the file's gradients give their parameters after each step, for every
  parameter this project's Pre-LN has."""
  g = golden(name)
  moments = unpack(g)
  config = completep_config(g)
  n_layer = config.model.n_layer
  params0 = completep_params(moments["param0"], n_layer)
  model = transformer.build_model(config.model)
  tokens_BT = np.zeros((1, config.model.context_length), np.int32)
  assert_same_structure(params0, model.init, tokens_BT)
  tx = optimizer.make_optimizer(config)

  @jax.jit
  def two_steps(params0, grad1, grad2):
    state = tx.init(params0)
    updates, state = tx.update(grad1, state, params0)
    params1 = jax.tree.map(jnp.add, params0, updates)
    updates, _ = tx.update(grad2, state, params1)
    return params1, jax.tree.map(jnp.add, params1, updates)
  params1, params2 = two_steps(params0, *(completep_params(moments[k], n_layer)
                                          for k in ("grad1", "grad2")))
  assert_trees_close(params1, completep_params(moments["param1"], n_layer), "after step 1")
  assert_trees_close(params2, completep_params(moments["param2"], n_layer), "after step 2")

"""The follow-up variants (docs/beyond_the_paper.md) held to their papers' formulas: Derf
(norm_type="derf"), Peri-LN (norm_position="peri") and gated attention (attn_output_gate), each
computed by hand from the parameters; each config trains, the speed package leaves it to the
reference model and the authors' format refuses it."""
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import special

from conftest import load_config, tiny_config
from simplified_flax import fast
from simplified_flax.data import build_pipeline
from simplified_flax.authors import config_map
from simplified_flax.model import block
from simplified_flax.model import layers
from simplified_flax.model import mlp as mlp_lib
from simplified_flax.model import transformer
from simplified_flax.runs import config_checks
from simplified_flax.sweeps import baseline
from simplified_flax.train import create_train_state, eval_step, train_step
from simplified_flax.training import diagnostics
from simplified_flax.training import optimizer

FOLLOWUPS = ("preln_derf", "peri_ln", "preln_gated", "sas_p_gated")
T = 16


def _perturbed(tree, scale=0.1, seed=0):
  """Every leaf moved off its initial value (unit scales, zero shifts and biases, zero
  queries would hide a parameter that is read wrongly or not at all)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(np.float32), tree)


def _tokens(length=T, seed=1):
  return jax.random.randint(jax.random.key(seed), (2, length), 0, 61)


# ------------------------------------------------------------------------------------------
# Derf
# ------------------------------------------------------------------------------------------
def test_derf_is_gamma_erf_alpha_x_plus_s_plus_beta_from_alpha_one_half_and_s_zero():
  x_BTD = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 8))) * 3
  norm = layers.Derf()
  init = norm.init(jax.random.key(1), x_BTD)["params"]
  assert (float(init["alpha_gain"]), float(init["shift_gain"])) == (0.5, 0.0)
  np.testing.assert_array_equal(init["scale"], np.ones(8))
  np.testing.assert_array_equal(init["bias"], np.zeros(8))
  alpha, s, gamma_D, beta_D = 1.7, -0.3, np.linspace(-1, 2, 8), np.linspace(0.5, -0.5, 8)
  params = {"alpha_gain": jnp.float32(alpha), "shift_gain": jnp.float32(s),
            "scale": jnp.asarray(gamma_D, jnp.float32), "bias": jnp.asarray(beta_D, jnp.float32)}
  out = norm.apply({"params": params}, x_BTD)
  np.testing.assert_allclose(out, gamma_D * special.erf(alpha * x_BTD + s) + beta_D,
                             rtol=1e-5, atol=1e-6)


def test_every_norm_of_a_derf_model_is_derf_its_scalars_logged_gains_never_decayed():
  config = tiny_config("preln_derf")
  params = jax.jit(transformer.build_model(config.model).init)(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  flat = traverse_util.flatten_dict(params, sep="/")
  shifts = sorted(k for k in flat if k.endswith("shift_gain"))
  # Each layer's norm1 and norm2, and the final norm (DyT's rule: every norm is replaced).
  assert shifts == ["h_0/norm1/shift_gain", "h_0/norm2/shift_gain", "h_1/norm1/shift_gain",
                    "h_1/norm2/shift_gain", "ln_f/shift_gain"]
  assert all(k.replace("shift", "alpha") in flat for k in shifts)
  mask = traverse_util.flatten_dict(optimizer.decay_mask(params), sep="/")
  assert not any(mask[k] or mask[k.replace("shift", "alpha")] for k in shifts)
  metrics = diagnostics.gain_metrics(params)
  assert {"gain/h_0/norm1_shift_gain", "gain/h_0/norm2_shift_gain",
          "gain/h_0/norm1_alpha_gain"} <= set(metrics)


# ------------------------------------------------------------------------------------------
# Peri-LN
# ------------------------------------------------------------------------------------------
def test_peri_ln_is_x_plus_norm_out_of_the_branch_of_norm_in_with_the_embedding_normed():
  config = tiny_config("peri_ln", attention_impl="explicit")
  m = ml_collections.FrozenConfigDict(config.model)
  model = transformer.build_model(config.model)
  tokens_BT = _tokens()
  variables = jax.jit(model.init)(jax.random.key(0), tokens_BT)
  flat = traverse_util.flatten_dict(variables["params"], sep="/")
  out_norms = sorted(k for k in flat if "_out/" in k or k.startswith("ln_emb/"))
  assert out_norms == ["h_0/norm1_out/scale", "h_0/norm2_out/scale", "h_1/norm1_out/scale",
                       "h_1/norm2_out/scale", "ln_emb/scale"]   # RMSNorms, as norm1 and norm2
  assert all(np.array_equal(flat[k], np.ones(m.n_embd)) for k in out_norms)   # unit scale
  params = _perturbed(variables["params"])
  rms = lambda x, p: layers.rms_norm(x, p["scale"], m.norm_eps, jnp.float32)

  @jax.jit
  def model_and_by_hand(params):
    logits_BTV = model.apply({**variables, "params": params}, tokens_BT)
    x_BTD = rms(params["wte"]["embedding"][tokens_BT] + params["wpe"]["embedding"][:T],
                params["ln_emb"])
    for layer in range(m.n_layer):
      p = params[f"h_{layer}"]
      attn_BTD = block.AttentionSubBlock(m, layer, causal=True).apply(
          {"params": p["attn"]}, rms(x_BTD, p["norm1"]), {})
      x_BTD = x_BTD + rms(attn_BTD, p["norm1_out"])
      mlp_BTD = mlp_lib.MLP(m).apply({"params": p["mlp"]}, rms(x_BTD, p["norm2"]))
      x_BTD = x_BTD + rms(mlp_BTD, p["norm2_out"])
    x_BTD = nn.LayerNorm(epsilon=m.norm_eps).apply({"params": params["ln_f"]}, x_BTD)
    # A norm after the branch: scaling the MLP's last weights leaves the output as it was.
    scaled = jax.tree.map(lambda x: x, params)
    scaled["h_0"]["mlp"]["c_proj"]["kernel"] = 10.0 * params["h_0"]["mlp"]["c_proj"]["kernel"]
    return (logits_BTV, x_BTD @ params["wte"]["embedding"].T,
            model.apply({**variables, "params": scaled}, tokens_BT))

  logits_BTV, by_hand_BTV, scaled_BTV = model_and_by_hand(params)
  np.testing.assert_allclose(logits_BTV, by_hand_BTV, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(scaled_BTV, logits_BTV, rtol=1e-3, atol=1e-3)
  assert np.abs(np.asarray(logits_BTV)).max() > 0.1


# ------------------------------------------------------------------------------------------
# Gated attention
# ------------------------------------------------------------------------------------------
def _sub_block_config(name, **overrides):
  return ml_collections.FrozenConfigDict(tiny_config(name, **overrides).model)


def test_gated_attention_is_proj_of_sigmoid_x_wg_times_sdpa_in_both_forms():
  m = {impl: _sub_block_config("preln_gated", attention_impl=impl)
       for impl in ("explicit", "fused")}
  B, D, H = 2, m["fused"].n_embd, m["fused"].n_head
  d = D // H
  x_BTD = np.asarray(jax.random.normal(jax.random.key(3), (B, T, D)), np.float64)
  sub = {impl: block.AttentionSubBlock(m[impl], 0, causal=True) for impl in m}
  init = jax.jit(sub["fused"].init)(jax.random.key(0), x_BTD.astype(np.float32), {})["params"]
  # A bias, as the authors' gate has where q has one (it is part of their q projection).
  assert set(init["gate"]) == {"kernel", "bias"} and not init["gate"]["bias"].any()
  assert init["gate"]["kernel"].shape == (D, D)
  assert 0.01 < float(jnp.std(init["gate"]["kernel"])) < 0.03   # N(0, 0.02)
  params = _perturbed(init, scale=0.3)
  outs = jax.jit(lambda p, x: {impl: s.apply({"params": p}, x, {}) for impl, s in sub.items()})(
      params, x_BTD.astype(np.float32))

  w = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  qk_BTF = x_BTD @ w["c_attn"]["kernel"] + w["c_attn"]["bias"]
  heads = lambda a_BTD: a_BTD.reshape(B, T, H, d).transpose(0, 2, 1, 3)   # [B, H, T, d]
  q_BHTd, k_BHTd = heads(qk_BTF[..., :D]), heads(qk_BTF[..., D:])
  v_BHTd = heads(x_BTD @ w["value"]["linear"]["kernel"])
  logits_BHTT = q_BHTd @ k_BHTd.transpose(0, 1, 3, 2) / np.sqrt(d)
  logits_BHTT = np.where(np.tril(np.ones((T, T), bool)), logits_BHTT, -np.inf)
  probs_BHTT = special.softmax(logits_BHTT, axis=-1)
  sdpa_BTD = (probs_BHTT @ v_BHTd).transpose(0, 2, 1, 3).reshape(B, T, D)
  gate_BTD = special.expit(x_BTD @ w["gate"]["kernel"] + w["gate"]["bias"])
  expected_BTD = (gate_BTD * sdpa_BTD) @ w["proj"]["linear"]["kernel"]
  for impl, out_BTD in outs.items():
    np.testing.assert_allclose(out_BTD, expected_BTD, rtol=1e-4, atol=1e-5, err_msg=impl)
  assert gate_BTD.std() > 0.1   # far from a constant gate, which any scaling would match


def test_gated_shaped_attention_gates_the_sas_output_equally_in_both_forms():
  """SAS-P's layer 1 (identity Value, no Proj): the sub-block's output is sigmoid(x W_g) times
  the ungated shaped attention's, elementwise, in the explicit and the fused form."""
  gated = {impl: _sub_block_config("sas_p_gated", attention_impl=impl)
           for impl in ("explicit", "fused")}
  plain = _sub_block_config("sas_p", attention_impl="explicit")
  x_BTD = jax.random.normal(jax.random.key(4), (2, T, plain.n_embd))
  sub = {impl: block.AttentionSubBlock(m, 1, causal=True) for impl, m in gated.items()}
  params = _perturbed(jax.jit(sub["fused"].init)(jax.random.key(0), x_BTD, {})["params"])

  @jax.jit
  def outputs(params):
    ungated = {k: v for k, v in params.items() if k != "gate"}
    return ({impl: s.apply({"params": params}, x_BTD, {}) for impl, s in sub.items()},
            block.AttentionSubBlock(plain, 1, causal=True).apply({"params": ungated}, x_BTD, {}))

  outs, ungated_BTD = outputs(params)
  gate_BTD = jax.nn.sigmoid(x_BTD @ params["gate"]["kernel"] + params["gate"]["bias"])
  for impl, out_BTD in outs.items():
    np.testing.assert_allclose(out_BTD, gate_BTD * ungated_BTD, rtol=1e-5, atol=1e-5,
                               err_msg=impl)


# Decoding from the cache (the gate on the running-sum path included): tests/test_decode.py
# checks every decoder config of configs/, these four among them, in both attention forms.


# ------------------------------------------------------------------------------------------
# Every follow-up config: checked, trained, left to the reference model, refused by conversion
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FOLLOWUPS)
def test_each_followup_config_trains_a_few_steps_on_the_cpu(name):
  config = tiny_config(name, n_layer=1)   # one layer: the train step's compile is the cost
  config.batch_size, config.num_train_steps = 4, 10
  config.optimizer.schedule, config.optimizer.warmup_steps = "constant", 0
  config.optimizer.learning_rate = 3e-3
  config_checks.validate_run_config(config)
  state = create_train_state(config, jax.random.key(0))
  step = jax.jit(train_step)
  batch = {"inputs": jax.random.randint(jax.random.key(5), (4, T), 0, 61)}
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", FOLLOWUPS)
def test_the_speed_package_leaves_each_followup_to_the_reference(name):
  config = tiny_config(name)
  for platform in ("cpu", "gpu", "tpu"):
    assert fast.choose(config.model, dtype=jnp.float32, platform=platform) is None, platform
  assert type(fast.build_model(config.model, platform="cpu")) is transformer.Transformer


@pytest.mark.parametrize("name,match", [
    ("preln_derf", "model.embedding_scale='learned'"), ("peri_ln", "model.norm_position='peri'"),
    ("preln_gated", "model.attn_output_gate=True"), ("sas_p_gated", "attn_output_gate=True")])
def test_the_authors_format_refuses_each_followup_in_one_line(name, match):
  with pytest.raises(config_map.ConversionError, match=match) as error:
    config_map.authors_config(tiny_config(name).model)
  assert "\n" not in str(error.value)


def test_bad_followup_values_name_the_field_and_the_fix():
  for overrides, message in (({"attn_output_gate": "yes"}, "model.attn_output_gate='yes'"),
                             ({"norm_position": "side"}, "model.norm_position='side'"),
                             ({"norm_position": "peri", "norm_type": "none"},
                              "norm_type='none' has no norm.*set model.norm_type")):
    m = dict(tiny_config("preln").model.to_dict(), **overrides)   # as a saved config holds it
    with pytest.raises(config_checks.ConfigError, match=message):
      config_checks.validate_model_config(ml_collections.ConfigDict(m))


# ------------------------------------------------------------------------------------------
# DyT with its authors' language-model recipe learns
# ------------------------------------------------------------------------------------------
DYT_STEPS = 100   # of the comparison's 300-step schedule, at its learning rate 1e-3


@pytest.mark.slow
def test_dyt_with_its_authors_recipe_leaves_the_unigram_plateau_at_the_comparisons_shape():
  """configs/preln_dyt.py at the follow-ups comparison's shape (L=4, D=128, T=64, batch 16,
  its 300-step schedule) on the embedded corpus: after DYT_STEPS steps its eval loss (the
  comparison's 8 eval batches) is clearly below the data's unigram loss, where without its
  authors' embedding scalar it stayed at that plateau for all 300 steps at every learning
  rate of the comparison."""
  config = load_config("preln_dyt", "cpu")
  config.model.update(n_layer=4, n_embd=128, n_head=4, context_length=64)
  config.batch_size, config.num_train_steps, config.eval_steps = 16, 300, 8
  config.optimizer.learning_rate = 1e-3
  assert config.model.embedding_scale == "learned"
  unigram = baseline.unigram_cross_entropy(config)
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  state = create_train_state(config, jax.random.PRNGKey(0))
  train, batches = jax.jit(train_step), pipeline.train_iterator(prefetch=0)
  for _ in range(DYT_STEPS):
    state, _ = train(state, next(batches))
  evaluate = jax.jit(eval_step)
  sums = [evaluate(state, b) for b in pipeline.eval_batches(config.eval_steps)]
  eval_loss = sum(float(s["loss_sum"]) for s in sums) / sum(float(s["weight_sum"]) for s in sums)
  assert eval_loss < unigram - 2 * baseline.LEARNED_MARGIN, (eval_loss, unigram)

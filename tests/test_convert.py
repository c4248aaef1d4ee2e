"""The authors' checkpoints in both directions: their state dict read by a numpy forward pass
written here from their code's equations (no torch), exact round trips, workdirs that evaluate
and sample read (the refusals: test_convert_errors.py). Where torch and their package are
importable, their model loads what --to_authors writes and gives the same logits."""
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy.special import erf
from safetensors.numpy import load_file

from conftest import ALL_CONFIGS, DECODER_VARIANTS, tiny_config
from simplified_flax.authors import config_map, dirs, expressible, params_map
from simplified_flax.model import scan_layout
from simplified_flax.model.transformer import build_model
from simplified_flax.runs import config_checks
from simplified_flax.training.evaluation import load_config, restore_read_only


# ------------------------------------------------------------------------------------------
# A numpy forward pass of their decoder from config.json + the state dict alone.
# ------------------------------------------------------------------------------------------
def _norm(t, name, x_TD, eps):
  if f"{name}.weight" in t:     # nn.LayerNorm
    mu = x_TD.mean(-1, keepdims=True)
    var = ((x_TD - mu) ** 2).mean(-1, keepdims=True)
    return (x_TD - mu) / np.sqrt(var + eps) * t[f"{name}.weight"] + t[f"{name}.bias"]
  if f"{name}.scale" in t:      # their RMSNorm: x / (||x|| / sqrt(d) + eps)
    rms = np.linalg.norm(x_TD, axis=-1, keepdims=True) * x_TD.shape[-1] ** -0.5
    return t[f"{name}.scale"] * x_TD / (rms + eps)
  return x_TD                   # nn.Identity


def _conv1d(t, name, x_TD):
  """Their MyConv1D: absent -> identity; reparameterised -> resid * W + skip * I (id W0)."""
  if f"{name}.weight" not in t:
    return x_TD
  w = t[f"{name}.weight"]
  if f"{name}.skip_gain" in t:
    w = t[f"{name}.resid_gain"][0] * w + t[f"{name}.skip_gain"][0] * np.eye(len(w))
  return x_TD @ w + t[f"{name}.bias"]


def _attention(t, c, p, x_TD):
  T, D, H = x_TD.shape[0], c["n_embd"], c["n_head"]
  d = D // H
  q_TD, k_TD = np.split(_conv1d(t, f"{p}.qk_attn", x_TD), 2, axis=-1)
  heads = lambda a: a.reshape(T, H, d).transpose(1, 0, 2)   # [H, T, d]
  q, k, v = heads(q_TD), heads(k_TD), heads(_conv1d(t, f"{p}.v_attn", x_TD))
  if c["qk_norm_type"] == "rmsnorm":
    q = _norm(t, f"{p}.q_norm", q, c["layer_norm_epsilon"])
    k = _norm(t, f"{p}.k_norm", k, c["layer_norm_epsilon"])
  logits = q @ k.transpose(0, 2, 1) / np.sqrt(d)
  if c["dot_norm_type"] == "tanh":
    logits = 30 * np.tanh(logits / 30)
  causal = np.tril(np.ones((T, T), bool))
  logits = np.where(causal, logits, -np.inf)
  a = np.exp(logits - logits.max(-1, keepdims=True))
  a = a / a.sum(-1, keepdims=True)
  a = t[f"{p}.attn_mat_resid_gain"].reshape(H, 1, 1) * a
  if c["centre_attn"]:
    centre = causal / np.arange(1, T + 1)[:, None]
    a = (a + t[f"{p}.attn_mat_skip_gain"].reshape(H, 1, 1) * np.eye(T)
         - t[f"{p}.centre_attn_gain"].reshape(H, 1, 1) * centre)
  return _conv1d(t, f"{p}.c_proj", (a @ v).transpose(1, 0, 2).reshape(T, D))


def _mlp(t, c, p, x_TD):
  h = _conv1d(t, f"{p}.c_fc", x_TD)
  if c["activation_function"] == "gelu":
    h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
  else:
    h = np.where(h >= 0, h, h * c["lrelu_neg_slope"])
  return _conv1d(t, f"{p}.c_proj", h)


def numpy_logits(folder, tokens_T):
  """[T, V] float64 logits of their model saved in `folder`, for one sequence."""
  c = json.loads(open(os.path.join(folder, "config.json")).read())
  t = {k: v.astype(np.float64) for k, v in load_file(os.path.join(folder,
                                                                   "model.safetensors")).items()}
  assert c["norm_position"] == "pre"
  eps = c["layer_norm_epsilon"]
  x = t["transformer.wte.weight"][tokens_T] + t["transformer.wpe.weight"][:len(tokens_T)]
  for layer in range(c["n_layer"]):
    p = f"transformer.h.{layer}"
    gain = lambda name: t[f"{p}.{name}"][0]
    h = _norm(t, f"{p}.ln_1", x, eps)
    if c["parallel_layers"]:
      out = gain("mlp_block_resid_gain") * _mlp(t, c, f"{p}.mlp", h) + gain(
          "attn_block_resid_gain") * _attention(t, c, f"{p}.attn", h)
      x = out + (gain("mlp_block_skip_gain") * x if c["mlp_block_skip_gain"] != 0 else 0)
      continue
    out = gain("attn_block_resid_gain") * _attention(t, c, f"{p}.attn", h)
    x = out + (gain("attn_block_skip_gain") * x if c["attn_block_skip_gain"] != 0 else 0)
    out = gain("mlp_block_resid_gain") * _mlp(t, c, f"{p}.mlp", _norm(t, f"{p}.ln_2", x, eps))
    x = out + (gain("mlp_block_skip_gain") * x if c["mlp_block_skip_gain"] != 0 else 0)
  x = _norm(t, "transformer.ln_f", x, eps)
  return x @ t["transformer.wte.weight"].T


# ------------------------------------------------------------------------------------------
# Helpers: a tiny model with every parameter moved off its init (gains included).
# ------------------------------------------------------------------------------------------
TOKENS_T = np.array([5, 17, 3, 42, 8, 60, 0, 11, 29, 7])


def _tiny(variant, **overrides):
  config = tiny_config(variant, **overrides)
  config_checks.validate_run_config(config)
  return config


def _perturbed_params(config, seed=0):
  model = build_model(config.model)
  variables = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
  leaves, tree = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  moved = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return model, variables, jax.tree.unflatten(tree, moved)


def _write_theirs(folder, config, params):
  m = config.model
  dirs.write_authors_dir(str(folder), config_map.authors_config(m),
                         params_map.to_state_dict(scan_layout.unstack_layers(params, m), m))


def _param_shapes(m):
  from simplified_flax.model.parameters import variable_shapes
  return {tuple(k.key for k in path): tuple(x.shape) for path, x in
          jax.tree_util.tree_leaves_with_path(variable_shapes(m)["params"])}


# ------------------------------------------------------------------------------------------
# Every variant in memory: logits equal the numpy forward pass; the round trip is exact.
# ------------------------------------------------------------------------------------------
# The decoder config files the authors' code cannot express, and the field each is refused on
# (authors/expressible.py). Every other decoder config file must convert: a field new to the
# authors' table refuses every run, and fails here.
# The first field (in the config's order) the authors' code lacks: DyT's and Derf's recipe
# scales the embedding, which their code never does.
REFUSED = {"preln_dyt": "embedding_scale", "sas_p_dyt": "embedding_scale",
           "preln_derf": "embedding_scale",
           "peri_ln": "norm_position", "preln_gated": "attn_output_gate",
           "sas_p_gated": "attn_output_gate", "ngpt": "ngpt", "completep": "depth_mup_alpha"}


@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_their_state_dict_gives_the_numpy_logits_and_round_trips_exactly(variant, tmp_path):
  config = _tiny(variant, attention_impl="explicit")
  if variant in REFUSED:   # one line naming the field, before anything is written
    with pytest.raises(config_map.ConversionError, match=rf"^model\.{REFUSED[variant]}=") as e:
      _write_theirs(tmp_path / "theirs", config, None)
    assert "\n" not in str(e.value) and not (tmp_path / "theirs").exists()
    return
  model, variables, params = _perturbed_params(config)
  _write_theirs(tmp_path, config, params)
  logits_TV = model.apply({**variables, "params": params}, TOKENS_T[None])[0]
  expected_TV = numpy_logits(tmp_path, TOKENS_T)
  np.testing.assert_allclose(np.asarray(logits_TV), expected_TV, rtol=2e-4, atol=2e-4)
  assert np.abs(expected_TV).max() > 0.1   # not a vanishing output that any mapping matches
  theirs, tensors, _ = dirs.read_authors_dir(str(tmp_path))
  fields = config_map.model_fields(theirs)
  assert {k: config.model[k] for k in fields} == fields
  assert dirs.workdir_config(fields)[1] == variant   # the config a converted workdir starts from
  back = params_map.from_state_dict(tensors, config.model, _param_shapes(config.model), "t")
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    assert a.dtype == np.float32 and np.array_equal(a, np.asarray(b))


def test_a_swapped_query_and_key_would_be_caught():
  """The numpy check is sharp: their qk_attn weight with halves swapped changes the logits."""
  config = _tiny("preln", attention_impl="explicit")
  model, variables, params = _perturbed_params(config)
  logits_TV = model.apply({**variables, "params": params}, TOKENS_T[None])[0]
  kernel = params["h_0"]["attn"]["c_attn"]["kernel"]
  D = config.model.n_embd
  params["h_0"]["attn"]["c_attn"]["kernel"] = jnp.concatenate([kernel[:, D:], kernel[:, :D]], 1)
  with tempfile.TemporaryDirectory() as folder:
    _write_theirs(folder, config, params)
    assert not np.allclose(np.asarray(logits_TV), numpy_logits(folder, TOKENS_T), atol=1e-3)


# ------------------------------------------------------------------------------------------
# Workdirs: from theirs, read by evaluate/sample's restore; back to theirs bitwise.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["preln", "sas_p"])
def test_workdir_round_trip_is_bitwise_and_its_logits_are_the_numpy_ones(variant, tmp_path):
  config = _tiny(variant, attention_impl="explicit", vocab_size=300)
  _, _, params = _perturbed_params(config)
  theirs, work, back = tmp_path / "theirs", str(tmp_path / "work"), tmp_path / "back"
  _write_theirs(theirs, config, params)
  spm = variant == "sas_p"   # this one with a SentencePiece model, which travels both ways
  if spm:
    from simplified_flax.data import tokenizers
    letters = np.random.default_rng(0).choice(list("abcdefgh"), (2000, 4))
    (theirs / "tokenizer.model").write_bytes(tokenizers.train_sentencepiece(
        [" ".join("".join(w) for w in letters)], vocab_size=290, max_chars=100_000))
  done = dirs.workdir_from_authors(str(theirs), work)
  assert done.variant == variant
  assert set(done.overrides) <= {"n_layer", "n_embd", "n_head", "vocab_size", "context_length"}
  saved = load_config(work)
  assert saved.data.tokenizer == ("sentencepiece" if spm else "byte")
  restored = restore_read_only(work, saved)     # what evaluate and sample read
  assert restored.step == 0 and restored.meta["converted_from"] == str(theirs)
  logits_TV = build_model(saved.model).apply(
      {"params": restored.state.params, **restored.state.constants}, TOKENS_T[None])[0]
  np.testing.assert_allclose(np.asarray(logits_TV), numpy_logits(theirs, TOKENS_T),
                             rtol=2e-4, atol=2e-4)
  dirs.authors_from_workdir(work, str(back))
  a, b = (load_file(str(f / "model.safetensors")) for f in (theirs, back))
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  if spm:
    assert (back / "tokenizer.model").read_bytes() == (theirs / "tokenizer.model").read_bytes()
  written = json.loads((back / "config.json").read_text())
  assert written.pop("bos_token_id") == written.pop("eos_token_id") == 1
  assert written == json.loads((theirs / "config.json").read_text())


# ------------------------------------------------------------------------------------------
# Their own model, where torch, transformers and their package are importable (not in CI).
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["preln", "sas_p", "op"])
def test_their_model_loads_what_to_authors_writes_and_gives_the_same_logits(variant, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model_utils = pytest.importorskip("simplified_transformers.model_utils")
  config = _tiny(variant, attention_impl="explicit")
  if variant.startswith("sas") and not torch.cuda.is_available():
    pytest.skip("their reparameterised Value layer puts its fixed matrix on CUDA")
  model, variables, params = _perturbed_params(config)
  _write_theirs(tmp_path, config, params)
  hf_config = transformers.GPT2Config.from_pretrained(str(tmp_path))
  theirs = model_utils.convertGPT2model(transformers.GPT2LMHeadModel(hf_config), hf_config)
  state = {k: torch.from_numpy(v) for k, v in load_file(str(tmp_path / "model.safetensors"))
           .items()}
  result = theirs.load_state_dict(state, strict=False)
  assert not result.unexpected_keys and set(result.missing_keys) <= {params_map.HEAD}
  theirs.tie_weights()
  device = "cuda" if torch.cuda.is_available() else "cpu"
  with torch.no_grad():
    logits_TV = theirs.to(device).eval()(torch.from_numpy(TOKENS_T)[None].to(device)).logits[0]
  expected_TV = model.apply({**variables, "params": params}, TOKENS_T[None])[0]
  np.testing.assert_allclose(logits_TV.cpu().numpy(), np.asarray(expected_TV), rtol=2e-4,
                             atol=2e-4)


def test_a_scanned_workdir_is_written_unrolled(tmp_path):
  from simplified_flax.runs import checkpoints
  from simplified_flax.training.step import create_train_state
  config = _tiny("preln", n_layer=3, scan_layers=True)
  unscanned = _tiny("preln", n_layer=3)
  _, _, params = _perturbed_params(unscanned)
  state = create_train_state(config, jax.random.PRNGKey(0))
  state = state.replace(params=scan_layout.stack_layers(params, config.model))
  manager = checkpoints.make_manager(str(tmp_path / "work"), 1, 1, async_save=False)
  checkpoints.save(manager, 0, state, {}, config.to_dict(), {})
  manager.wait_until_finished()
  manager.close()
  (tmp_path / "work" / "config.json").write_text(json.dumps(config.to_dict()))
  dirs.authors_from_workdir(str(tmp_path / "work"), str(tmp_path / "theirs"))
  written = load_file(str(tmp_path / "theirs" / "model.safetensors"))
  expected = params_map.to_state_dict(params, unscanned.model)
  assert written.keys() == expected.keys()
  assert all(np.array_equal(written[k], expected[k]) for k in expected)


def test_training_continues_from_a_converted_workdir(tmp_path):
  from simplified_flax.train import train_and_evaluate
  from test_loop import make_config, write_corpus
  config = _tiny("sas_p", vocab_size=300)   # the byte tokenizer's ids fit
  _, _, params = _perturbed_params(config)
  _write_theirs(tmp_path / "theirs", config, params)
  work = str(tmp_path / "work")
  done = dirs.workdir_from_authors(str(tmp_path / "theirs"), work)
  overrides = {**write_corpus(tmp_path), **{f"model.{k}": v for k, v in done.overrides.items()},
               "num_train_steps": 2, "batch_size": 4, "eval_every_steps": 0}
  train_and_evaluate(make_config(overrides, done.variant), work, tensorboard=False)
  restored = restore_read_only(work, load_config(work))
  assert restored.step == 2
  moved = restored.state.params["h_0"]["mlp"]["c_fc"]["kernel"]
  assert not np.array_equal(np.asarray(moved), np.asarray(params["h_0"]["mlp"]["c_fc"]["kernel"]))


# ------------------------------------------------------------------------------------------
# The authors' table (authors/expressible.py): what --to_authors writes, and what it refuses.
# ------------------------------------------------------------------------------------------
def test_every_field_of_every_config_file_is_in_the_authors_table():
  for name in ALL_CONFIGS:
    assert expressible.unclassified(tiny_config(name).model) == [], name
  tables = set(expressible.EXPRESSIBLE), expressible.NOT_WRITTEN, set(expressible.UNREAD_UNLESS)
  assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])


def test_every_value_the_table_admits_is_written_and_read_back():
  """The table and the writer agree: each value a field's check admits (a finite set of them)
  gives their config.json, which reads back to it; a field their config.json does not carry
  admits one value, their code's own behaviour."""
  base = tiny_config("preln").model
  carried = set(config_map.model_fields(config_map.authors_config(base)))
  for field, check in expressible.EXPRESSIBLE.items():
    values = getattr(check, "values", None)
    if field not in carried:
      assert values is not None and len(values) == 1, field
    for value in values or ():
      m = base.to_dict() | {field: value}
      if field in base and expressible.refusal(m) is None:
        fields = config_map.model_fields(config_map.authors_config(
            ml_collections.ConfigDict(m)))
        assert fields.get(field, value) == value, (field, value)


def test_a_field_or_value_their_code_lacks_is_refused_in_one_line_before_anything_is_written(
    tmp_path):
  """A throwaway field (a researcher's new shaping term) and a throwaway value of a known
  field (an activation theirs lacks): --to_authors refuses each in one line naming the field
  and value, where a writer that read only the fields it knows would drop the term (their
  model would compute something else) or fail on the value with a KeyError."""
  m = tiny_config("sas_p").model
  for field, value, line in [
      ("prev_token_attn_gain", 0.3, r"^model\.prev_token_attn_gain=0\.3 is new to the authors' "
                                    r"format \(simplified_flax/authors/expressible\.py\)"),
      ("activation", "relu2", r"^model\.activation='relu2': the authors' code has only "
                              r"'leaky_relu' or 'gelu' for activation; this run cannot be "
                              r"written as theirs")]:
    changed = ml_collections.ConfigDict(m.to_dict() | {field: value})
    with pytest.raises(config_map.ConversionError, match=line) as error:
      config_map.authors_config(changed)
    assert "\n" not in str(error.value)
  # From a workdir: refused before the checkpoint is read, the output folder never made.
  config = _tiny("sas_p")
  config.model.prev_token_attn_gain = 0.3
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "config.json").write_text(json.dumps(config.to_dict()))
  with pytest.raises(config_map.ConversionError, match="model.prev_token_attn_gain=0.3 is new"):
    dirs.authors_from_workdir(str(tmp_path / "work"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_fields_their_code_lacks_convert_where_unread_and_are_refused_where_read():
  m = tiny_config("preln").model.to_dict()
  assert expressible.refusal(m | {"depth_mup_base_layers": 1}) is None   # without alpha: unread
  assert expressible.refusal(m | {"alpha_init_attn_norm": 0.2}) is None  # no DyT norm reads it
  assert expressible.refusal(m | {"scan_layers": True, "grad_rules": "off"}) is None
  line = expressible.refusal(m | {"norm_type": "dyt", "alpha_init_attn_norm": 0.2})
  assert line.startswith("model.norm_type='dyt': the authors' code has only"), line
  # The line names the field that selects what their code lacks, not the one it makes read.
  line = expressible.refusal({"rope_theta": 500.0, "position_embedding": "rope"})
  assert line.startswith("model.position_embedding='rope': the authors' code has only"), line

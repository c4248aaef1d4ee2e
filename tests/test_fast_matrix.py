"""The speed package held to the reference model: every config file of configs/ (listed, never typed),
under each platform's plan (the CPU's; the GPU's and TPU's with their Pallas kernels in interpret
mode), in both attention forms, has the reference's parameter tree and its loss and gradients
(float32; bfloat16 on a subset), at the initial parameters and at parameters moved off them
(`moved`: at the initial ones several fast paths agree with the reference by accident). Where
a config's values are not verified the plan is None and the fast model is the reference
itself, which these tests check too. The reference's two attention forms are held to each
other in every config (falling-back ones included).

Tolerances: the rules and kernels change the order of sums, never their terms, so each
gradient leaf may differ by round-off relative to its own largest entry, plus round-off of
the terms it sums (a scalar gain's gradient is a sum over every token and feature that
cancels): a small fraction of the model's largest gradient. float32: that round-off;
bfloat16: about one rounding step of the compute dtype.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ALL_CONFIGS, DECODER_VARIANTS, ENCODER_VARIANTS, tiny_config
from simplified_flax import fast
from simplified_flax.fast import grad_rules
from simplified_flax.fast import plan as plan_lib
from simplified_flax.model import attention
from simplified_flax.model import layers
from simplified_flax.model import transformer

PLATFORMS = ("cpu", "gpu", "tpu")
FORMS = ("explicit", "fused")
BATCH, SEQ = 2, 16
# The TPU's combine kernels and its chunked prefix sums take T % 128 == 0: its fused form runs
# at this length where they apply (centred decoders). Elsewhere the TPU's fused form has no
# kernel of its own at T=16 but splash, which tests/test_attention_kernels*.py check.
TPU_KERNEL_SEQ = 128
BFLOAT16_CONFIGS = ("preln", "sas", "sas_p", "op")
# (loss rtol, gradient rtol of a leaf's largest entry, of the model's largest gradient)
TOLERANCE = {"float32": (2e-5, 2e-5, 1e-6), "bfloat16": (2e-2, 8e-2, 8e-3)}
# Where the matrix compares: the model's initial parameters and parameters moved off them
# (`moved`), as training moves them.
POINTS = ("initial", "moved")
MOVE, MOVE_SEED = 0.5, 7


def _seq_len(config, platform: str, form: str) -> int:
  m = config.model
  tpu_kernels = m.centre_attn and m.kind == "decoder" and (platform, form) == ("tpu", "fused")
  return TPU_KERNEL_SEQ if tpu_kernels else SEQ


def _config(name: str, form: str, seq_len: int = SEQ):
  return tiny_config(name, attention_impl=form, context_length=seq_len)


def _batch(config):
  """Tokens [B, T] and, for an encoder, a padding mask with one short row."""
  T = config.model.context_length
  tokens_BT = jax.random.randint(jax.random.key(0), (BATCH, T), 0, config.model.vocab_size)
  if config.model.kind == "decoder":
    return tokens_BT, {}
  return tokens_BT, {"key_mask": jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])}


def _loss(model, variables, tokens_BT, kwargs):
  """params -> the mean next-token cross-entropy of `model` on tokens_BT."""
  def loss(params):
    logits_BTV = model.apply({**variables, "params": params}, tokens_BT, **kwargs)
    logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1))
  return loss


def _fast_model(config, platform: str, dtype: str):
  """The fast model of `platform`'s plan, or None where its plan is None (unverified values:
  the speed package builds the reference itself, which this checks)."""
  model = fast.build_model(config.model, dtype, platform=platform, interpret=platform != "cpu")
  if fast.choose(config.model, dtype=jnp.float32, platform=platform) is None:
    assert type(model) is transformer.Transformer, (config.model.norm_type, platform)
    return None
  return model


def moved(params, seed: int = MOVE_SEED):
  """`params` moved off their initial values, as training moves them: every leaf plus seeded
  Gaussian noise of MOVE times its own RMS (PLAIN_STD where that is 0: zero biases, SAS's zero
  queries), gains and norm scales included. At the initial parameters several fast paths
  agree with the reference by accident (SAS's attention is the identity there, A = C with
  zero queries and beta = gamma; gains that follow each other are equal); here no block is at
  its identity and no two gains are equal. numpy's generator: no program to compile."""
  rng = np.random.default_rng(seed)
  def move(x):
    x = np.asarray(x)
    rms = float(np.sqrt(np.mean(np.square(x))))
    noise = rng.standard_normal(x.shape).astype(x.dtype)
    return jnp.asarray(x + (MOVE * rms if rms > 0 else layers.PLAIN_STD) * noise)
  return jax.tree.map(move, params)


def _forms_of(config, forms):
  """The attention forms of `forms` the reference runs for `config`: the fused form refuses
  soft-capped logits (it raises, so it cannot be wrong)."""
  return tuple(f for f in forms if f == "explicit" or config.model.dot_norm_type != "tanh")


def _cases(name: str, dtype: str, forms, platforms):
  """(the reference's initial variables, {case: params -> loss}, [(where, case, its
  reference case)]): the fast model of each of `platforms`' plans in each of `forms` against
  the reference in that form, and the reference's explicit form against its fused one (in
  float32, every config, falling-back ones included: a shaping term written in one form and
  not the other fails there)."""
  config = _config(name, forms[0])
  tokens_BT, kwargs = _batch(config)
  reference = transformer.build_model(config.model, dtype)
  variables = jax.jit(lambda key: reference.init(key, tokens_BT, **kwargs))(jax.random.key(1))
  losses, compared = {}, []   # case -> loss(params); (where, its case, the reference's case)
  def reference_case(form, seq_len):
    form_config = _config(name, form, seq_len)
    case = f"reference, {form}, T={seq_len}"
    losses.setdefault(case, _loss(transformer.build_model(form_config.model, dtype), variables,
                                  *_batch(form_config)))
    return case
  forms = _forms_of(config, forms)
  for form in forms:
    for platform in platforms:
      seq_len = _seq_len(config, platform, form)
      form_config = _config(name, form, seq_len)
      model = _fast_model(form_config, platform, dtype)
      if model is None:
        continue
      # Same parameters under the same names: a checkpoint moves between the two.
      shapes = jax.eval_shape(lambda m=model: m.init(jax.random.key(1), tokens_BT, **kwargs))
      assert jax.tree.structure(shapes) == jax.tree.structure(variables), (name, platform)
      losses[f"{platform}, {form}"] = _loss(model, variables, *_batch(form_config))
      compared.append((f"{name} on the {platform} plan, {form} form, {dtype}",
                       f"{platform}, {form}", reference_case(form, seq_len)))
  if dtype == "float32" and len(forms) == 2:
    compared.append((f"{name}'s reference, explicit form against the fused form",
                     reference_case("explicit", SEQ), reference_case("fused", SEQ)))
  return variables, losses, compared


def _worst(results, compared, dtype: str):
  """(the largest deviation over `compared` as a multiple of what TOLERANCE allows, where):
  at most 1 where every loss and gradient leaf is within tolerance. `results` in numpy: no
  program of its own to compile."""
  loss_rtol, leaf_rtol, model_rtol = TOLERANCE[dtype]
  worst = (0.0, "")
  for where, case, reference_case in compared:
    (loss, grads), (ref_loss, ref_grads) = results[case], results[reference_case]
    worst = max(worst, (float(abs(loss - ref_loss) / (loss_rtol * abs(ref_loss))),
                        f"{where}: the loss {float(loss)!r} against {float(ref_loss)!r}"))
    largest = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
    for (path, ref_g), g in zip(jax.tree_util.tree_flatten_with_path(ref_grads)[0],
                                jax.tree.leaves(grads)):
      atol = leaf_rtol * float(np.max(np.abs(ref_g))) + model_rtol * largest
      worst = max(worst, (float(np.max(np.abs(g - ref_g))) / atol,
                          f"{where}: the gradient of {jax.tree_util.keystr(path)}"))
  return worst


def _gradientless(results, compared, parallel: bool) -> list[str]:
  """The parameters whose gradient in a compared reference case is zero everywhere, which a
  comparison therefore never checks; but a parallel block's norm2, which it creates and never
  reads (model/block.py)."""
  names = set()
  for _, _, reference_case in compared:
    for path, g in jax.tree_util.tree_flatten_with_path(results[reference_case][1])[0]:
      name = jax.tree_util.keystr(path)
      if not np.any(g) and not (parallel and "['norm2']" in name):
        names.add(name)
  return sorted(names)


def deviations(name: str, dtype: str, forms=FORMS, platforms=PLATFORMS, points=POINTS):
  """{point: `_worst` there} for the initial and the moved parameters (`moved`). One program
  computes every case's loss and gradients (the reference once per form and sequence length;
  the parameters are the same at any length) and takes the parameters as its argument, so a
  config costs one compile however many points it is checked at. At the moved parameters
  every parameter has a gradient to compare (`_gradientless`)."""
  variables, losses, compared = _cases(name, dtype, forms, platforms)
  program = jax.jit(lambda p: {k: jax.value_and_grad(f)(p) for k, f in losses.items()})
  at = {"initial": variables["params"], "moved": moved(variables["params"])}
  results = {point: jax.device_get(program(at[point])) for point in points}
  assert program._cache_size() <= 1, "the second point compiled again"  # pylint: disable=protected-access
  if "moved" in results:
    unchecked = _gradientless(results["moved"], compared, tiny_config(name).model.parallel_layers)
    assert not unchecked, f"{name}: no gradient to compare at the moved parameters: {unchecked}"
  return {point: _worst(result, compared, dtype) for point, result in results.items()}


def _check(name: str, dtype: str, forms=FORMS, platforms=PLATFORMS):
  """Every case of `_cases` within TOLERANCE at the initial and the moved parameters."""
  for point, (ratio, where) in deviations(name, dtype, forms, platforms).items():
    assert ratio <= 1, f"{where}, at the {point} parameters: {ratio:.3g} times the tolerance"


@pytest.mark.parametrize("name", ["sas", "value_skipinit"])
def test_the_fast_model_initialises_the_references_values(name):
  """Training initialises through the reference model (fast.ModelApply only applies); GLUE
  builds its encoder through the speed package. Its initial values are the reference's:
  checked on SAS (identity-anchored value, zero queries) and Value-SkipInit (orthogonal
  value and projection); every config's tree is checked above."""
  config = _config(name, "explicit")
  tokens_BT, kwargs = _batch(config)
  model = _fast_model(config, "gpu", "float32")
  if model is None:
    return
  reference = transformer.build_model(config.model)
  inits = jax.jit(lambda key: (reference.init(key, tokens_BT, **kwargs),
                               model.init(key, tokens_BT, **kwargs)))(jax.random.key(1))
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, *inits))), name


def _same_model_as_a_variant(name: str):
  """For a config file that is no variant (base.py), the variant whose model config equals
  its own, if any (base.py's is preln.py's): the matrix checks that model there."""
  variants = DECODER_VARIANTS + ENCODER_VARIANTS
  if name in variants:
    return None
  model = tiny_config(name).model.to_dict()
  return next((v for v in variants if tiny_config(v).model.to_dict() == model), None)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_the_fast_model_equals_the_reference_on_every_plan_in_both_forms(name):
  """One test per config file (the reference is then made once per form, on one worker)."""
  twin = _same_model_as_a_variant(name)
  if twin is not None:
    pytest.skip(f"{name}'s model config is {twin}'s, checked there")
  _check(name, "float32")


@pytest.mark.parametrize("name,platform", [(n, "gpu") for n in BFLOAT16_CONFIGS]
                         + [("sas_p", "tpu")])
def test_the_fast_model_equals_the_reference_in_bfloat16(name, platform):
  """The GPU's plan (its bfloat16 paths: the held combine and residual, relu_matmul) on four
  variants; the TPU's on SAS-P, whose Mosaic combine kernels take it."""
  _check(name, "bfloat16", forms=("fused",), platforms=(platform,))


def test_the_moved_parameters_catch_what_the_initial_ones_let_through(monkeypatch):
  """The matrix's own test: an edit to the reference's maths that a fast path does not share,
  and that agrees with it at the initial parameters. Here the reference's RMS norm subtracts
  its input's mean first. On the GPU's plan SAS's norm2 takes its sums of squares from the
  combine kernel (the `norm_stats` rule), of the uncentred input; at the initial parameters
  that input has zero mean anyway (the attention sub-block is the identity there, after a
  norm1 that now centres), so the two agree: 0.03 of the tolerance. At the moved parameters
  they do not: 2,400 times the tolerance, the gradient of the second layer's MLP kernel."""
  rms_norm = layers.rms_norm
  def centring_rms_norm(x, scale, eps, dtype):
    return rms_norm(x - jnp.mean(x.astype(jnp.float32), axis=-1, keepdims=True), scale, eps,
                    dtype)
  monkeypatch.setattr(layers, "rms_norm", centring_rms_norm)
  worst = deviations("sas", "float32", forms=("fused",), platforms=("gpu",))
  (initial, _), (after_moving, where) = worst["initial"], worst["moved"]
  assert initial <= 1 < 100 < after_moving, (initial, after_moving, where)
  assert "['h_1']['mlp']" in where, where


def test_a_shaping_term_in_one_attention_form_alone_fails_the_forms_check(monkeypatch):
  """The reference's two forms held to each other, in a config no fast path runs (gated
  attention): a term added to the explicit form's `shaping_terms` and not to `fused_terms`
  (here 0.1 times the mask's own matrix) fails."""
  shaping_terms = attention.shaping_terms
  def with_a_term_more(mask, **kwargs):
    gain_H = jnp.full((kwargs["num_heads"],), 0.1, jnp.float32)
    return shaping_terms(mask, **kwargs) + [(gain_H, mask.astype(jnp.float32))]
  monkeypatch.setattr(attention, "shaping_terms", with_a_term_more)
  ratio, where = deviations("preln_gated", "float32")["moved"]
  assert ratio > 100 and "explicit form against the fused form" in where, (ratio, where)


def test_the_matrix_runs_the_kernels_and_rules_it_claims_to_check():
  """The shapes above take every kernel: otherwise the matrix would compare the reference
  with itself. Counted in the jaxprs of the fused forms of SAS-P (parallel) and SAS."""
  def pallas_calls(name, platform):
    config = _config(name, "fused", _seq_len(_config(name, "fused"), platform, "fused"))
    tokens_BT, _ = _batch(config)
    model = fast.build_model(config.model, platform=platform, interpret=True)
    variables = model.init(jax.random.key(1), tokens_BT)
    grad = jax.grad(lambda p: jnp.sum(model.apply({**variables, "params": p}, tokens_BT)))
    return str(jax.make_jaxpr(grad)(variables["params"])).count("pallas_call")
  # GPU: per layer the combine forward and backward, and relu_matmul's backward.
  assert pallas_calls("sas_p", "gpu") >= 3 * 2
  assert pallas_calls("sas", "gpu") >= 3 * 2
  # TPU: the Mosaic combine forward and backward per layer.
  assert pallas_calls("sas_p", "tpu") >= 2 * 2


def test_every_model_field_is_verified_or_ignored_by_the_fast_path():
  """A field added to configs/base.py must be classified in fast/plan.py before the fast path
  runs for it: VERIFIED (with the values it was checked on) or IGNORED (it cannot change what
  a block computes from its parameters)."""
  base_fields = set(tiny_config("preln").model.keys())
  assert plan_lib.unclassified(tiny_config("preln").model) == []
  assert set(plan_lib.VERIFIED) | plan_lib.IGNORED <= base_fields, "a stale entry"
  assert not set(plan_lib.VERIFIED) & plan_lib.IGNORED


def test_an_unclassified_field_fails_the_classification_and_builds_the_reference(caplog):
  config = tiny_config("sas_p")
  config.model.centre_attn_temperature = 2.0   # a researcher's new knob
  assert plan_lib.unclassified(config.model) == ["centre_attn_temperature"]
  plan_lib.forget_logged_lines()
  with caplog.at_level("WARNING"):
    model = fast.build_model(config.model, platform="gpu", interpret=True)
  assert type(model) is transformer.Transformer
  assert caplog.text.count("model.centre_attn_temperature is new to the speed package") == 1


def test_an_unverified_value_trains_on_the_reference_and_says_so_once(caplog):
  """A throwaway config with a value nobody verified (post-norm): the train step runs the
  reference model, with one log line naming the field and value, and its loss is the
  reference model's."""
  from simplified_flax.training import step  # pylint: disable=import-outside-toplevel
  config = tiny_config("preln", norm_position="post")
  config.batch_size = BATCH
  state = step.create_train_state(config, jax.random.key(0))
  tokens_BT = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, config.model.vocab_size)
  plan_lib.forget_logged_lines()
  with caplog.at_level("WARNING"):
    _, metrics = jax.jit(step.train_step)(state, {"inputs": tokens_BT})
    jax.jit(step.eval_step)(state, {"inputs": tokens_BT})
  lines = [r.getMessage() for r in caplog.records if "reference model" in r.getMessage()]
  assert lines == ["Running the reference model: model.norm_position='post' was not verified "
                   "for the fast path (verified: 'pre'); see docs/fast.md, 'Verifying a new "
                   "setting'."]
  reference = transformer.build_model(config.model)
  sums = step._loss_sums(state.replace(apply_fn=reference.apply), state.params,  # pylint: disable=protected-access
                         {"inputs": tokens_BT}, train=True, key=jax.random.key(0))
  np.testing.assert_allclose(metrics["loss"], sums["loss_sum"] / sums["weight_sum"], rtol=1e-6)


def test_off_is_the_reference_and_auto_applies_each_rule_on_its_platform():
  config = tiny_config("sas_p")
  config.model.grad_rules = "off"
  assert fast.choose(config.model, dtype=jnp.float32, platform="gpu") is None
  config.model.grad_rules = "auto"
  for platform in PLATFORMS:
    plan = fast.choose(config.model, dtype=jnp.float32, platform=platform)
    assert plan.rules == {r for r, where in grad_rules.AUTO_PLATFORM.items() if platform in where}
  config.model.grad_rules = "on,-relu_matmul,-combine"
  plan = fast.choose(config.model, dtype=jnp.float32, platform="cpu")
  assert plan.rules == set(grad_rules.AUTO_PLATFORM) - {"relu_matmul", "combine"}
  # "auto" attention resolves per platform and dtype (attention_kernels.resolve_impl).
  config.model.grad_rules = "auto"
  assert fast.choose(config.model, dtype=jnp.bfloat16, platform="gpu").attention_impl == "fused"
  assert fast.choose(config.model, dtype=jnp.float32, platform="gpu").attention_impl == "explicit"
  assert fast.choose(config.model, dtype=jnp.float32, platform="cpu").attention_impl == "explicit"


def test_the_reference_model_imports_no_speed_code_and_reads_no_platform():
  """model/ is the papers' maths: no module of it imports simplified_flax.fast or asks JAX
  which platform it runs on (the speed package decides that, once, for its plan)."""
  import ast  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  platform_reads = {"devices", "default_backend", "local_devices", "backend", "platform"}
  model_dir = pathlib.Path(transformer.__file__).parent
  for path in sorted(model_dir.glob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        assert not (node.module or "").startswith("simplified_flax.fast"), path.name
      if isinstance(node, ast.Import):
        assert not any(a.name.startswith("simplified_flax.fast") for a in node.names), path.name
      if isinstance(node, ast.Attribute):
        assert node.attr not in platform_reads, f"{path.name}:{node.lineno} reads .{node.attr}"

"""The pure training API: a train state, one optimiser step, one evaluation step.

    state = create_train_state(config, jax.random.PRNGKey(0))    # config.model.vocab_size set
    train = jax.jit(train_step, donate_argnums=0)
    for tokens_BT in batches:
      state, metrics = train(state, {"inputs": tokens_BT})         # {"loss", "grad_norm", ...}
    sums = jax.jit(eval_step)(state, batch)                        # {"loss_sum", "weight_sum"}
    diag = jax.jit(diagnostics_step)(state, batch)                 # diagnostics scalars

A decoder batch is {"inputs": int32[B, T]} (+ optional "segment_ids"); an encoder batch adds
"targets", "weights" (+ optional "key_mask"). Both steps are pure and jittable; under
`jax.pmap` pass `axis_name` and they average gradients and losses with `lax.pmean`.

The loss: with `model.loss_vocab_chunk_size` > 0 (the default) both steps read the model's
final hidden states (`return_hidden=True`) and score them against the tied embedding
`params["wte"]["embedding"]` chunk by chunk (chunked_loss.py), never holding the [B, T, V]
logits; 0 scores the model's full float32 logits as before.
"""
import dataclasses
from typing import Any, Callable

from flax import struct
import jax
import jax.numpy as jnp
import optax

from simplified_flax.training import chunked_loss
from simplified_flax.training import diagnostics
from simplified_flax.training import losses
from simplified_flax.training import mlm_metrics
from simplified_flax.training import optimizer as optim
from simplified_flax.training import placement as parallel
from simplified_flax.model.transformer import build_model

# Model collections that are outputs of `apply`, never state.
_OUTPUT_COLLECTIONS = ("intermediates",)


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What the step computes, beyond the model and optimiser (hashable, static under jit)."""
  kind: str                    # "decoder" or "encoder"
  grad_accum_steps: int = 1
  head: chunked_loss.HeadSpec | None = None   # None: the loss reads the model's logits


@struct.dataclass
class TrainState:
  """Everything a step reads and writes; the static fields are not saved in checkpoints."""
  step: jax.Array              # int32[]: optimiser updates applied so far
  params: Any                  # float32 master weights, the only trained arrays
  constants: Any               # other model collections (fixed anchors): never trained/decayed
  opt_state: Any
  rng: jax.Array               # uint32[2] base key; update s draws from fold_in(rng, s)
  apply_fn: Callable = struct.field(pytree_node=False)
  tx: optax.GradientTransformation = struct.field(pytree_node=False)
  schedule: Callable = struct.field(pytree_node=False)
  spec: StepSpec = struct.field(pytree_node=False)


def _raw_key(rng) -> jax.Array:
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  return jnp.asarray(rng, jnp.uint32)


def create_train_state(config, rng, mesh=None, model=None) -> TrainState:
  """A fresh state: model init from `rng`, AdamW state, step 0.

  With a `mesh` the state is created directly in its shardings (`parallel.state_shardings`).
  `model` defaults to `build_model(config.model, dtype=config.dtype)`; any linen module with
  the same call signature works.
  """
  if config.model.vocab_size is None:   # the one field a checked config may leave unset
    raise ValueError("model.vocab_size is unset: set it to the tokenizer's vocabulary size "
                     "(the training script does this from config.data).")
  model = model if model is not None else build_model(config.model, dtype=config.dtype)
  tx = optim.make_optimizer(config)
  schedule = optim.make_schedule(config.optimizer, config.num_train_steps)
  spec = StepSpec(kind=config.model.kind, grad_accum_steps=config.grad_accum_steps,
                  head=chunked_loss.HeadSpec.from_config(config.model, config.dtype))
  tokens_BT = jnp.zeros((1, config.model.context_length), jnp.int32)

  def init(rng):
    init_key, train_key = jax.random.split(rng)
    variables = model.init({"params": init_key}, tokens_BT)
    params = variables["params"]
    constants = {k: v for k, v in variables.items()
                 if k != "params" and k not in _OUTPUT_COLLECTIONS}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, constants=constants,
                      opt_state=tx.init(params), rng=train_key, apply_fn=model.apply, tx=tx,
                      schedule=schedule, spec=spec)

  rng = _raw_key(rng)
  abstract = jax.eval_shape(init, rng)
  not_f32 = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
      abstract.params) if x.dtype != jnp.float32]
  if not_f32:
    raise ValueError(f"Master weights must be float32 (the compute dtype is config.dtype); "
                     f"these are not: {not_f32[:5]}")
  if mesh is None:
    return jax.jit(init)(rng)
  return jax.jit(init, out_shardings=parallel.state_shardings(abstract, mesh))(rng)


def _apply(state: TrainState, params, batch: dict, *, train: bool, key,
           return_hidden: bool = False) -> jax.Array:
  """The model's float32 logits [B, T, V], or its final hidden states [B, T, D]."""
  variables = {"params": params, **state.constants}
  extra = {"return_hidden": True} if return_hidden else {}
  return state.apply_fn(variables, batch["inputs"], segment_ids=batch.get("segment_ids"),
                        key_mask=batch.get("key_mask"), train=train,
                        rngs={"dropout": key} if train else None, **extra)


def _loss_sums(state: TrainState, params, batch: dict, *, train: bool, key,
               with_correct: bool = False) -> dict[str, jax.Array]:
  """{"loss_sum", "weight_sum"} (+ "correct_sum" with `with_correct`) of `batch`: chunked
  from the hidden states when `state.spec.head` is set, else from the full logits."""
  head = state.spec.head
  if head is None:
    logits_BTV = _apply(state, params, batch, train=train, key=key)
    with jax.named_scope("loss"):   # names the loss's ops in profiles (benchmark_breakdown)
      sums = losses.loss_sums(logits_BTV, batch, state.spec.kind)
      if with_correct:
        sums = {**sums, **mlm_metrics.correct_sums(logits_BTV, batch)}
    return sums
  hidden_BTD = _apply(state, params, batch, train=train, key=key, return_hidden=True)
  with jax.named_scope("loss"):
    return losses.hidden_loss_sums(hidden_BTD, params["wte"]["embedding"], batch,
                                   state.spec.kind, head, with_correct=with_correct)


def train_step(state: TrainState, batch: dict,
               axis_name: str | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on the token-mean loss of `batch` (all rows of all devices).

  Gradients are summed over `grad_accum_steps` micro-batches (and over devices under pmap)
  before dividing by the number of scored tokens, so accumulation and data parallelism give
  the same update as one big batch. Returns metrics "loss" (this batch, before the update),
  "grad_norm" (before clipping) and "learning_rate" (used by this update).
  """
  step_key = jax.random.fold_in(state.rng, state.step)
  if axis_name is not None:
    step_key = jax.random.fold_in(step_key, jax.lax.axis_index(axis_name))

  def sum_grad_fn(params, micro_batch, index):
    def loss_fn(p):
      sums = _loss_sums(state, p, micro_batch, train=True,
                        key=jax.random.fold_in(step_key, index))
      return sums["loss_sum"], sums
    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, sums

  grads, sums = optim.accumulate_gradients(sum_grad_fn, state.params, batch,
                                           state.spec.grad_accum_steps)
  if axis_name is not None:
    # Means of sums over devices: their ratios are the global token means.
    grads, sums = jax.lax.pmean((grads, sums), axis_name)
  with jax.named_scope("optimizer"):   # names the update's ops in profiles
    tokens = jnp.where(sums["weight_sum"] > 0, sums["weight_sum"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, opt_state=opt_state,
                              params=optax.apply_updates(state.params, updates))
    metrics = {"loss": sums["loss_sum"] / tokens, "grad_norm": optax.tree.norm(grads),
               "learning_rate": jnp.asarray(state.schedule(state.step), jnp.float32)}
  return new_state, metrics


def eval_step(state: TrainState, batch: dict,
              axis_name: str | None = None) -> dict[str, jax.Array]:
  """Summed loss and scored-token count of `batch` (over all devices under pmap); for the
  encoder also the count of masked tokens predicted exactly ("correct_sum")."""
  sums = _loss_sums(state, state.params, batch, train=False, key=None,
                    with_correct=state.spec.kind == "encoder")
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return sums


def diagnostics_step(state: TrainState, batch: dict, axis_name: str | None = None,
                     apply_fn: Callable | None = None) -> dict[str, jax.Array]:
  """The signal-propagation diagnostics of the current parameters on `batch` (one forward pass,
  no update): `diagnostics.collect` of the sown intermediates, e.g. {"kurtosis/layer_0": f32[]}.

  `apply_fn` (default `state.apply_fn`) may be the same model on the explicit attention path,
  whose softmax probabilities give the attention entropy (the fused path sows none). Under
  pmap each device reports its own rows (the loop logs the first device's).
  """
  del axis_name   # statistics of one device's rows; no collective
  apply_fn = apply_fn or state.apply_fn
  _, mutated = apply_fn({"params": state.params, **state.constants}, batch["inputs"],
                        segment_ids=batch.get("segment_ids"), key_mask=batch.get("key_mask"),
                        train=False, mutable=["intermediates"])
  return diagnostics.collect(mutated["intermediates"], state.params)

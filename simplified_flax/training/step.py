"""The pure training API: a train state, one optimiser step, one evaluation step.

    state = create_train_state(config, jax.random.PRNGKey(0))    # config.model.vocab_size set
    state, metrics = jax.jit(train_step, donate_argnums=0)(state, {"inputs": tokens_BT})
    sums = jax.jit(eval_step)(state, batch)                        # {"loss_sum", "weight_sum"}
    diag = jax.jit(diagnostics_step)(state, batch)                 # diagnostics scalars

A decoder batch is {"inputs": int32[B, T]} (+ optional "segment_ids"); an encoder batch adds
"targets", "weights" (+ optional "key_mask"). Under `jax.pmap` pass `axis_name`: the steps then
average gradients and losses with `lax.pmean`. The loss reads the chunked tied head
(chunked_loss.py) unless `model.loss_vocab_chunk_size` is 0 (the full float32 logits).
"""
import dataclasses
from typing import Any, Callable

from flax import struct
import jax
import jax.numpy as jnp
import optax

from simplified_flax import fast
from simplified_flax.fast import layers as fast_layers
from simplified_flax.training import chunked_loss
from simplified_flax.training import diagnostics
from simplified_flax.training import losses
from simplified_flax.training import optimizer
from simplified_flax.training import placement
from simplified_flax.model.transformer import build_model

# loss_fn(state, params, batch, *, train, key) -> {"loss_sum", "weight_sum", ...}: float32 sums.
LossFn = Callable[..., dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What the step computes, beyond the model and optimiser (hashable, static under jit)."""
  kind: str                    # "decoder" or "encoder"
  grad_accum_steps: int = 1
  head: chunked_loss.HeadSpec | None = None   # None: the loss reads the model's logits
  copy_table: bool = False     # the head and the lookup read fast_layers.table_copies (no FSDP)
  shard_update: bool = False   # each device updates its slice of the weights (placement.py)


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


def create_train_state(config, rng, mesh=None, model=None) -> TrainState:
  """A fresh state (model init from `rng`, step 0) of a checked config, made in the shardings
  of `mesh` if given. `model` (default: the model of `config.model`, initialised as the reference
  `build_model(config.model, config.dtype)` and applied through the speed package's
  `fast.ModelApply`, which picks the fast model for the platform each step is compiled for)
  may be any linen module with the same call signature (GLUE's classifier)."""
  init, rng = _initializer(config, model, rng)
  abstract = _checked_abstract_state(init, rng)
  if mesh is None:
    return jax.jit(init)(rng)
  return jax.jit(init, out_shardings=placement.state_shardings(
      abstract, mesh, placement.shards_update(config)))(rng)


def abstract_train_state(config, model=None) -> TrainState:
  """`create_train_state`'s result as shapes and dtypes (ShapeDtypeStruct leaves), computing
  nothing: what a step is compiled against ahead of time."""
  init, rng = _initializer(config, model, jax.random.PRNGKey(config.seed))
  return _checked_abstract_state(init, rng)


def _initializer(config, model, rng):
  """(`init(rng) -> TrainState`, `rng` as uint32 key data) for `config`."""
  if config.model.vocab_size is None:   # the one field a checked config may leave unset
    raise ValueError("model.vocab_size is unset: set it to the tokenizer's vocabulary size "
                     "(the training script does this from config.data).")
  if model is None:
    model = build_model(config.model, dtype=config.dtype)
    apply_fn = fast.ModelApply(model.cfg, config.dtype)
  else:
    apply_fn = model.apply
  tx = optimizer.make_optimizer(config)
  schedule = optimizer.make_schedule(config.optimizer, config.num_train_steps)
  spec = StepSpec(kind=config.model.kind, grad_accum_steps=config.grad_accum_steps,
                  head=chunked_loss.HeadSpec.from_config(config.model, config.dtype),
                  copy_table=config.parallel.fsdp == 1,
                  shard_update=placement.shards_update(config))
  tokens_BT = jnp.zeros((1, config.model.context_length), jnp.int32)

  def init(rng):
    init_key, train_key = jax.random.split(rng)
    variables = model.init({"params": init_key}, tokens_BT)
    params = variables["params"]
    constants = {k: v for k, v in variables.items()   # intermediates: outputs, never state
                 if k not in ("params", "intermediates")}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, constants=constants,
                      opt_state=tx.init(params), rng=train_key, apply_fn=apply_fn, tx=tx,
                      schedule=schedule, spec=spec)

  typed_key = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  rng = jax.random.key_data(rng) if typed_key else jnp.asarray(rng, jnp.uint32)
  return init, rng


def _checked_abstract_state(init, rng) -> TrainState:
  abstract = jax.eval_shape(init, rng)
  not_f32 = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
      abstract.params) if x.dtype != jnp.float32]
  if not_f32:
    raise ValueError(f"Master weights must be float32 (the compute dtype is config.dtype); "
                     f"these are not: {not_f32[:5]}")
  return abstract


def apply_model(state: TrainState, params, batch: dict, *, train: bool, key=None, **kwargs):
  """The model's output on `batch` (LM: float32 logits [B, T, V]; `return_hidden=True`: the
  final hidden states [B, T, D]); `key` draws the dropout when `train`."""
  return state.apply_fn({"params": params, **state.constants}, batch["inputs"],
                        segment_ids=batch.get("segment_ids"), key_mask=batch.get("key_mask"),
                        train=train, rngs={"dropout": key} if train else None, **kwargs)


def _loss_sums(state: TrainState, params, batch: dict, *, train: bool, key,
               with_correct: bool = False) -> dict[str, jax.Array]:
  """The token loss's `LossFn` (+ "correct_sum" with `with_correct`): chunked from the hidden
  states when `state.spec.head` is set, else from the full logits."""
  head = state.spec.head
  if head is None:
    logits_BTV = apply_model(state, params, batch, train=train, key=key)
    with jax.named_scope("loss"):   # names its ops in profiles (experiments/step_breakdown.py)
      return losses.loss_sums(logits_BTV, batch, state.spec.kind, with_correct)
  tied = "lm_head" not in params   # model.tie_head=False: the head has a table of its own
  table_VD = params["wte" if tied else "lm_head"]["embedding"]
  # A table sharded by FSDP is whole on no device: its copies would gather it on each. They
  # serve the token lookup too, so only where the head is the token table.
  copies = (fast_layers.table_copies(table_VD, batch["inputs"].shape[0])
            if state.spec.copy_table and not with_correct and tied else None)
  hidden_BTD = apply_model(state, params, batch, train=train, key=key, return_hidden=True,
                           **({"table_copies": copies} if copies is not None else {}))
  with jax.named_scope("loss"):
    return losses.hidden_loss_sums(hidden_BTD, table_VD, batch, state.spec.kind, head,
                                   with_correct=with_correct, table_copies=copies)


def train_step(state: TrainState, batch: dict, axis_name: str | None = None,
               loss_fn: LossFn | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimiser update on the weighted-mean loss of `batch` (all rows of all devices).

  `loss_fn` defaults to the model's token loss (GLUE passes its task loss). Summed gradients
  are added over micro-batches and devices before dividing by the summed weight: the update of
  one big batch. Metrics: "loss" (before the update), "grad_norm" (before clipping),
  "learning_rate" (of this update).
  """
  loss_fn = loss_fn or _loss_sums
  step_key = jax.random.fold_in(state.rng, state.step)
  if axis_name is not None:
    step_key = jax.random.fold_in(step_key, jax.lax.axis_index(axis_name))

  def sum_grad_fn(params, micro_batch, index):
    def summed_loss(p):
      sums = loss_fn(state, p, micro_batch, train=True, key=jax.random.fold_in(step_key, index))
      return sums["loss_sum"], sums
    (_, sums), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
    return grads, sums

  grads, sums = optimizer.accumulate_gradients(sum_grad_fn, state.params, batch,
                                               state.spec.grad_accum_steps)
  if axis_name is not None:
    # Means of sums over devices: their ratios are the global token means.
    grads, sums = jax.lax.pmean((grads, sums), axis_name)
  params = state.params
  if state.spec.shard_update:   # under jit on a mesh: each device updates its slice
    grads, params = placement.slices_for_update(grads, params)
  with jax.named_scope("optimizer"):   # names the update's ops in profiles
    tokens = jnp.where(sums["weight_sum"] > 0, sums["weight_sum"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = state.tx.update(grads, state.opt_state, params)
    new_state = state.replace(step=state.step + 1, opt_state=opt_state,
                              params=optax.apply_updates(params, updates))
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


def diagnostics_step(state: TrainState, batch: dict,
                     axis_name: str | None = None) -> dict[str, jax.Array]:
  """`diagnostics.collect` of the current parameters on `batch` (one forward pass, no update),
  e.g. {"kurtosis/layer_0": f32[]}. Under pmap each device reports its own rows."""
  del axis_name   # statistics of one device's rows; no collective
  _, mutated = apply_model(state, state.params, batch, train=False, mutable=["intermediates"])
  return diagnostics.collect(mutated["intermediates"], state.params)

"""The fast model: `transformer.Transformer` (the same parameters, under the same names) whose
layers are `fast.block.Block` under one `Plan`, and whose token lookup is `shard_map`ped."""
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax

from simplified_flax.fast import block as fast_block
from simplified_flax.fast import layers as fast_layers
from simplified_flax.fast import plan as plan_lib
from simplified_flax.fast import target_platform
from simplified_flax.model import transformer


class Transformer(transformer.Transformer):
  """`transformer.Transformer` under `plan`. `table_copies` (`fast.layers.table_copies` of the
  `wte` table): the token lookup reads them, as the training loss's head does."""
  plan: plan_lib.Plan = None

  @nn.compact
  def __call__(self, tokens_BT, *, table_copies=None, **kwargs):
    lookup = fast_layers.embedding_lookup if table_copies is None else table_copies.lookup
    return self.forward(tokens_BT, lookup=lookup, **kwargs)

  @nn.nowrap
  def block_class(self) -> type:
    return fast_block.Block

  @nn.nowrap
  def block_attributes(self) -> dict:
    return {"plan": self.plan}

  @nn.nowrap
  def remat_policy(self) -> Callable:
    return keep_matmuls_and_kernels


# The attention kernels' forward primitives (cuDNN's; splash and other Pallas kernels): a
# scanned block keeps their outputs like a matmul's, so that the backward never runs the
# forward kernel again.
KERNEL_PRIMITIVES = frozenset({"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper",
                               "pallas_call"})


def keep_matmuls_and_kernels(prim, *avals, **params) -> bool:
  """The remat policy of scan_residuals="matmuls": keep an output of a matmul (any
  dot_general, batched ones included: the explicit path's scores) or of an attention kernel."""
  return (prim.name in KERNEL_PRIMITIVES
          or jax.checkpoint_policies.checkpoint_dots(prim, *avals, **params))


def build_model(model_config, dtype="float32", *, platform: str | None = None,
                interpret: bool = False) -> transformer.Transformer:
  """The model for `model_config` computing in `dtype` on `platform` (default: the platform
  the step is compiled for, target_platform.py): the fast model where `plan.choose` gives a
  plan, else the reference model (`transformer.build_model`). Either initialises the same
  parameters. `interpret`: the Pallas kernels in interpret mode (a platform's plan on a CPU)."""
  dtype = transformer.DTYPES[dtype] if isinstance(dtype, str) else dtype
  plan = plan_lib.choose(model_config, dtype=dtype, interpret=interpret,
                         platform=platform or target_platform.current())
  if plan is None:
    return transformer.build_model(model_config, dtype)
  reference = transformer.build_model(model_config, dtype)
  return Transformer(reference.cfg, reference.causal, reference.dtype, plan=plan)


@dataclasses.dataclass(frozen=True)
class ModelApply:
  """`model.apply` for a train state (`TrainState.apply_fn`): the model is chosen when a step
  is traced, for the platform it is compiled for (`target_platform.compiling_for`), so one
  state serves every target. Equal configs give equal functions (a static jit argument)."""
  model_config: Any   # FrozenConfigDict
  dtype: str

  def __call__(self, variables, *args, table_copies=None, **kwargs):
    model = build_model(self.model_config, self.dtype)
    if isinstance(model, Transformer) and table_copies is not None:
      kwargs["table_copies"] = table_copies
    return model.apply(variables, *args, **kwargs)

"""The one parameter counter: of variable trees, or of a config's model without allocating it."""
from typing import Dict

import jax
import jax.numpy as jnp

from simplified_flax.model import transformer

EMBEDDINGS = ("wte", "wpe", "lm_head")   # token, position and untied head tables: left out of
                                        # the non-embedding count


def size(tree) -> int:
  """Number of scalars in a tree of arrays or ShapeDtypeStructs."""
  return sum(x.size for x in jax.tree.leaves(tree))


def variable_shapes(model_config):
  """The model's variables as ShapeDtypeStructs; nothing is allocated or computed."""
  model = transformer.build_model(model_config)
  tokens = jax.ShapeDtypeStruct((1, model_config.context_length), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def counts(variables, breakdown: bool = False) -> Dict:
  """{"total": every array (fixed anchors included), "trainable": the `params` collection,
  "non_embedding": trainable minus the token, position and head tables} of a variables tree
  ({"params": ..., "constants": ...}); with `breakdown`, trainable per top-level module."""
  params = variables["params"]
  result = {"total": size(variables), "trainable": size(params),
            "non_embedding": size({k: v for k, v in params.items() if k not in EMBEDDINGS})}
  if breakdown:
    result["breakdown"] = {name: size(sub) for name, sub in params.items()}
  return result


def count_parameters(model_config, breakdown: bool = False) -> Dict:
  """`counts` of the model `model_config` describes."""
  return counts(variable_shapes(model_config), breakdown)

"""Parameter counts of a model config without allocating the parameters (`jax.eval_shape`)."""
from typing import Dict

import jax
import jax.numpy as jnp

from simplified_flax.model import transformer

EMBEDDINGS = ("wte", "wpe")


def variable_shapes(model_config):
  """The model's variables as ShapeDtypeStructs; nothing is allocated or computed."""
  model = transformer.build_model(model_config)
  tokens = jax.ShapeDtypeStruct((1, model_config.context_length), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def count_parameters(model_config, breakdown: bool = False) -> Dict:
  shapes = variable_shapes(model_config)
  params = shapes["params"]
  counts = {
      "total": _size(shapes),
      "trainable": _size(params),
      "non_embedding": _size({k: v for k, v in params.items() if k not in EMBEDDINGS}),
  }
  if breakdown:
    counts["breakdown"] = {name: _size(sub) for name, sub in params.items()}
  return counts

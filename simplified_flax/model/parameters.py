"""The one parameter counter: of variable trees, or of a config's model without allocating it."""
import functools
import json
from typing import Dict

import jax
import jax.numpy as jnp
import ml_collections

from simplified_flax.model import transformer

EMBEDDINGS = ("wte", "wpe")   # left out of the non-embedding count


def size(tree) -> int:
  """Number of scalars in a tree of arrays or ShapeDtypeStructs."""
  return sum(x.size for x in jax.tree.leaves(tree))


def variable_shapes(model_config):
  """The model's variables as ShapeDtypeStructs; nothing is allocated or computed."""
  model = transformer.build_model(model_config)
  tokens = jax.ShapeDtypeStruct((1, model_config.context_length), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def parameter_shapes(config_dict: dict) -> dict[str, tuple[int, ...]]:
  """{parameter path: shape} of the model a (saved, JSON) config dict describes; traced once
  per distinct model config (a restore compares each checkpoint it tries)."""
  return dict(_parameter_shapes(json.dumps(config_dict["model"], sort_keys=True)))


@functools.lru_cache(maxsize=32)
def _parameter_shapes(model_json: str) -> dict[str, tuple[int, ...]]:
  params = variable_shapes(ml_collections.ConfigDict(json.loads(model_json)))["params"]
  return {jax.tree_util.keystr(path): tuple(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(params)}


def counts(variables, breakdown: bool = False) -> Dict:
  """{"total": every array (fixed anchors included), "trainable": the `params` collection,
  "non_embedding": trainable minus token and position embeddings} of a variables tree
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

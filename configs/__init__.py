"""One config file per variant (`configs/<name>.py`, `get_config(arg)`), and `load` to build
one by name with dotted overrides, as scripts, tests and notebooks need."""
import importlib
from typing import Any, Mapping, Optional

import ml_collections


def load(spec: str, overrides: Optional[Mapping[str, Any]] = None) -> ml_collections.ConfigDict:
  """`"sas_p"` or `"sas_p:cpu"` -> `configs/sas_p.py`'s `get_config("cpu")`, then `overrides`
  (`{"model.n_layer": 4}`) applied in place. A dotted key that names no existing field raises
  KeyError naming it, so a typo never adds a field that nothing reads."""
  name, _, arg = spec.partition(":")
  try:
    module = importlib.import_module(f"configs.{name}")
  except ModuleNotFoundError as err:
    raise ValueError(f"No config file configs/{name}.py; pass the name of a file in configs/ "
                     "(e.g. 'preln' or 'sas_p:cpu').") from err
  config = module.get_config(arg)
  overrides = dict(overrides or {})
  for dotted in overrides:
    node = config
    for part in dotted.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise KeyError(f"Config override {dotted!r}: {spec} has no field {part!r} there; "
                       "check the spelling against the config file.")
      node = node[part]
  config.update_from_flattened_dict(overrides)
  return config

"""One config file per variant (`configs/<name>.py`, `get_config(arg)`), and `load` to build
one by name with dotted overrides, as scripts, tests and notebooks need.

Installed, this folder is the package `simplified_flax.configs`; in a checkout both
`import configs` and `from simplified_flax import configs` reach it. Config files import each
other relatively (`from . import base`), so they work under either name."""
from typing import Any, Mapping, Optional

import ml_collections


def load(spec: str, overrides: Optional[Mapping[str, Any]] = None) -> ml_collections.ConfigDict:
  """`"sas_p"`, `"sas_p:cpu"` or `"path/to/file.py:cpu"` -> that file's `get_config("cpu")`,
  then `overrides` (`{"model.n_layer": 4}`) applied in place. An unknown name or switch raises
  ValueError naming the known ones; a dotted key that names no existing field raises KeyError
  naming it, so a typo never adds a field that nothing reads."""
  from simplified_flax import config_files  # pylint: disable=import-outside-toplevel
  config = config_files.load(spec)
  overrides = dict(overrides or {})
  fields = dict(config_files.dotted_items(config))
  for dotted in overrides:
    if dotted not in fields:
      raise KeyError(f"Config override {dotted!r}: {spec} has no field {dotted!r}; check the "
                     "spelling against the config file.")
  config.update_from_flattened_dict(overrides)
  return config

"""Config files: shipped ones by name, the user's by path, the run's saved `config.json`, and
the one walker of dotted field paths (`model.n_layer`).

`--config=sas_p:cpu`, `sas_p.py:cpu`, `configs/sas_p.py:cpu` and `path/to/mine.py:cpu` work
from any folder. The files are the package `simplified_flax.configs` (a checkout registers its
`configs/` under that name), inside which a user's file loads too (`from . import sas` works).
"""
import difflib
import hashlib
import importlib
import importlib.util
import pathlib
import sys
import types
from typing import Any, Iterator

from absl import flags

PACKAGE = "simplified_flax.configs"
_HERE = pathlib.Path(__file__).resolve().parent
_CHECKOUT_CONFIGS = _HERE.parent / "configs"
CONFIG_FILE = "config.json"   # the resolved config a training run writes to its workdir
FLAG_HELP = ("A config name (sas_p, preln, bert_sas_p, ...) or the path of a .py file with "
             "get_config(), then :switches, e.g. sas_p:cpu (docs/configs.md).")


class ConfigSpecError(ValueError):
  """A --config value that names no config file, or a switch no config knows."""


def dotted_items(tree, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted path, value) of every field of a nested dict or ConfigDict, each section before
  its fields: {"model": {"n_layer": 2}} -> ("model", {...}), ("model.n_layer", 2)."""
  for key, value in tree.items():
    yield prefix + key, value
    if hasattr(value, "items"):
      yield from dotted_items(value, f"{prefix}{key}.")


def configs_package() -> types.ModuleType:
  """The wheel's `simplified_flax.configs`, or a checkout's `configs/` under that name."""
  if PACKAGE in sys.modules:
    return sys.modules[PACKAGE]
  installed = (_HERE / "configs" / "__init__.py").is_file()
  in_checkout = ((_CHECKOUT_CONFIGS / "base.py").is_file()
                 and (_HERE.parent / "pyproject.toml").is_file())
  if installed or not in_checkout:
    return importlib.import_module(PACKAGE)
  spec = importlib.util.spec_from_file_location(
      PACKAGE, _CHECKOUT_CONFIGS / "__init__.py",
      submodule_search_locations=[str(_CHECKOUT_CONFIGS)])
  package = importlib.util.module_from_spec(spec)
  sys.modules[PACKAGE] = package
  spec.loader.exec_module(package)
  setattr(sys.modules["simplified_flax"], "configs", package)
  return package


def known_configs() -> list[str]:
  """The names of the shipped config files (`sas_p`, `preln`, ...)."""
  folder = pathlib.Path(configs_package().__file__).parent
  return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def known_switches() -> tuple[str, ...]:
  return tuple(importlib.import_module(f"{PACKAGE}.base").SWITCHES)


def load(spec: str):
  """`"name[:switches]"` or `"path.py[:switches]"` -> that file's `get_config(switches)`; a
  missing file or unknown switch raises ConfigSpecError before any config code runs."""
  target, _, arg = spec.partition(":")
  module, shipped = _module_for(target)
  if shipped:
    unknown = sorted({s for s in arg.split(",") if s} - set(known_switches()))
    if unknown:
      raise ConfigSpecError(f"Unknown config switch {', '.join(map(repr, unknown))} in "
                            f"{spec!r}; {_known_text()}")
  if not hasattr(module, "get_config"):
    raise ConfigSpecError(f"{target} defines no get_config(arg); a config file returns its "
                          "ConfigDict from get_config (see configs/base.py).")
  return module.get_config(arg)


def _module_for(target: str) -> tuple[types.ModuleType, bool]:
  """(module, whether it is a shipped config) for a name or a path."""
  path = pathlib.Path(target).expanduser()
  shipped_dir = pathlib.Path(configs_package().__file__).resolve().parent
  if path.is_file():
    if path.resolve().parent == shipped_dir:
      return importlib.import_module(f"{PACKAGE}.{path.stem}"), True
    return _load_user_file(path), False
  stem = path.name[:-3] if path.name.endswith(".py") else path.name
  # A bare name, or the docs' `configs/<name>.py` run from another folder.
  if stem in known_configs() and str(path.parent) in (".", "configs"):
    return importlib.import_module(f"{PACKAGE}.{stem}"), True
  close = difflib.get_close_matches(stem, known_configs(), n=1, cutoff=0.6)
  hint = f"did you mean {close[0]!r}? " if close else ""
  raise ConfigSpecError(f"No config file {target!r}: {hint}give a config name or the path of "
                        f"a .py file with get_config(); {_known_text()}")


def _load_user_file(path: pathlib.Path) -> types.ModuleType:
  resolved = path.resolve()
  digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
  name = f"{PACKAGE}._file_{resolved.stem}_{digest}"
  spec = importlib.util.spec_from_file_location(name, resolved)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def _known_text() -> str:
  return (f"known configs: {', '.join(known_configs())}; switches after ':' (comma-separated): "
          f"{', '.join(known_switches())}; e.g. --config=sas_p:cpu")


class ConfigSpecParser(flags.ArgumentParser):
  """absl parser of a --config value through `load` (locked, as ml_collections locks it)."""

  def parse(self, argument):
    config = load(argument) if isinstance(argument, str) else argument
    if callable(getattr(config, "lock", None)):
      config.lock()
    return config

  def flag_type(self):
    return "config object"


def define_config_flag(help_string: str = FLAG_HELP):
  """The ml_collections flag `--config=spec` (+ `--config.field=value`), resolved by `load`."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  holder = config_flags.DEFINE_config_file("config", None, help_string)
  flags.FLAGS["config"].parser = ConfigSpecParser()
  return holder

"""A sweep's runs: every variant × every point of the grid × every seed, each one
`python -m simplified_flax.train` command with a workdir of its own.

A run is its train command's arguments (the config spec and `--config.FIELD=VALUE` texts, as a
user would type them), so `--print` shows exactly what `run_all` executes. `build` parses every
run's config the way the train command will (ml_collections' flag parser) and checks it before
any run starts: an unknown field, a value that does not parse or that the config check refuses,
an empty product, or two runs that would share a workdir are each one `SweepError` line.
"""
import dataclasses
import difflib
import itertools
import json
import re
import shlex
from typing import Mapping, Sequence

from absl import flags

from simplified_flax import config_files
from simplified_flax import storage

TRAIN_MODULE = "simplified_flax.train"
SEED_FIELD = "seed"   # model init and data order (configs/base.py)


class SweepError(ValueError):
  """A sweep that cannot run as asked; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of a sweep.

  `point` is the run's grid values, {field: value as parsed}, without the seed; `overrides`
  every `--config.FIELD=VALUE` of its command (shared ones, then the grid's, then the seed).
  """
  name: str
  variant: str
  point: tuple[tuple[str, object], ...]
  seed: int
  config_spec: str
  overrides: tuple[str, ...]
  workdir: str
  steps: int   # config.num_train_steps: the run is finished when its history reaches it

  def train_args(self) -> list[str]:
    """The arguments after `python -m simplified_flax.train`."""
    return [f"--config={self.config_spec}", *self.overrides, f"--workdir={self.workdir}"]

  def command(self, python: str = "python") -> str:
    return shlex.join([python, "-m", TRAIN_MODULE, *self.train_args()])

  def point_text(self) -> str:
    return ", ".join(f"{field}={format_value(value)}" for field, value in self.point) or "-"


def format_value(value) -> str:
  """A grid value as run names and reports show it: 0.001 -> "0.001", 3e-4 -> "0.0003"."""
  return f"{value:g}" if isinstance(value, float) else str(value)


def parse_grid(texts: Sequence[str]) -> list[tuple[str, list[str]]]:
  """["optimizer.learning_rate=1e-3,3e-3", ...] -> [(field, ["1e-3", "3e-3"]), ...]. Values
  that contain commas are separated by '|' instead (`--grid=model.grad_rules=on|auto,-gains`)."""
  grid = []
  for text in texts:
    field, sep, values = text.partition("=")
    field = field.strip()
    if not sep or not field:
      raise SweepError(f"--grid={text}: give FIELD=VALUE,VALUE,... e.g. "
                       "--grid=optimizer.learning_rate=1e-3,3e-3")
    split = values.split("|") if "|" in values else values.split(",")
    split = [v.strip() for v in split]
    if not any(split) or "" in split:
      raise SweepError(f"--grid={text}: an empty value; give FIELD=VALUE,VALUE,... with no "
                       "empty entry.")
    if field in dict(grid):
      raise SweepError(f"--grid={field}=... is given twice; give all its values in one "
                       f"--grid={field}=v1,v2,...")
    if field == SEED_FIELD:
      raise SweepError(f"--grid={text}: the seed is swept by --seeds=N (seeds are paired "
                       "across variants in the report), not by --grid.")
    grid.append((field, split))
  return grid


def _parse_config(spec: str, overrides: Sequence[str]):
  """The config `python -m simplified_flax.train --config=spec *overrides` trains: parsed by
  the same ml_collections flag parser, on a FlagValues of its own."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  argv = ["sweep", f"--config={spec}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, config_files.FLAG_HELP, flag_values=values,
                                  sys_argv=argv)
  values["config"].parser = config_files.ConfigSpecParser()
  values(argv)
  return values.config


def _field_of(override: str) -> str:
  return override.split("=", 1)[0].removeprefix("--config.").removeprefix("--noconfig.")


def _check_fields(spec: str, fields: Sequence[tuple[str, str]]) -> None:
  """Each (flag text, dotted field) names a field of `spec`'s config, else one line with the
  closest field."""
  config = config_files.load(spec)
  known = sorted(path for path, _ in config_files.dotted_items(config))
  for flag_text, field in fields:
    if field not in known:
      close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
      fix = f"did you mean {close[0]}?" if close else "see the config file for the field names."
      raise SweepError(f"{flag_text}: the config {spec} has no field '{field}'; {fix}")


def _short_names(fields: Sequence[str]) -> dict[str, str]:
  """The last part of each dotted field, or the whole path where two grid fields share it."""
  last = [f.rsplit(".", 1)[-1] for f in fields]
  return {f: (s if last.count(s) == 1 else f) for f, s in zip(fields, last)}


def _safe(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._+=-]", "-", text)


def run_name(variant: str, point: Sequence[tuple[str, object]], seed: int,
             short: Mapping[str, str]) -> str:
  """`sas_p__learning_rate=0.003__s1`: readable, and unique for distinct configs."""
  parts = [variant] + [f"{short[f]}={format_value(v)}" for f, v in point] + [f"s{seed}"]
  return _safe("__".join(parts))


def variant_spec(config_spec: str, variant: str) -> str:
  """`--config=sas_p:cpu` with variant `preln` -> `preln:cpu` (the switches stay)."""
  _, colon, switches = config_spec.partition(":")
  return f"{variant}{colon}{switches}"


def build(config_spec: str, shared: Sequence[str], variants: Sequence[str],
          grid_texts: Sequence[str], seeds: int, workdir_root: str,
          check_existing: bool = True) -> list[Run]:
  """Every run of the sweep, in running order (seed 0 of every variant and point first, so a
  cut sweep has the most comparisons), each config parsed and checked; or one SweepError.

  `shared`: the `--config.FIELD=VALUE` texts every run takes; `variants`: config names (empty:
  the config of `config_spec` alone); `seeds`: runs per point, seeds config.seed + 0..N-1.
  With `check_existing`, a workdir that holds a run of another config is refused too.
  """
  # pylint: disable-next=import-outside-toplevel
  from simplified_flax.runs.config_checks import ConfigError, validate_run_config
  base_name = config_spec.partition(":")[0]
  variants = list(variants) or [base_name]
  if len(set(variants)) != len(variants):
    raise SweepError(f"--variants={','.join(variants)} names a config twice; name each once.")
  if seeds < 1:
    raise SweepError(f"--seeds={seeds}: the sweep would have no runs; give --seeds=1 or more.")
  grid = parse_grid(grid_texts)
  shared_fields = {_field_of(o) for o in shared}
  for field, _ in grid:
    if field in shared_fields:
      raise SweepError(f"--grid={field}=... and --config.{field}=... both set {field}; keep one.")
  for variant in variants:
    spec = variant_spec(config_spec, variant)
    try:
      _check_fields(spec, [(o.split("=", 1)[0], _field_of(o)) for o in shared]
                    + [(f"--grid={f}", f) for f, _ in grid])
    except config_files.ConfigSpecError as error:
      raise SweepError(f"--variants: {error}") from None
  short = _short_names([f for f, _ in grid])
  # A shared --config.seed=K only moves the first seed: each run's own seed flag replaces it.
  own_shared = [o for o in shared if _field_of(o) != SEED_FIELD]
  runs, names = [], {}
  points = list(itertools.product(*[[(f, v) for v in values] for f, values in grid]))
  for seed_index in range(seeds):
    for variant in variants:
      spec = variant_spec(config_spec, variant)
      for point in points:
        grid_overrides = [f"--config.{f}={v}" for f, v in point]
        try:
          config = _parse_config(spec, [*shared, *grid_overrides])
        except (flags.Error, ValueError) as error:
          raise SweepError(f"--grid: {' '.join(str(error).split())}") from None
        seed = config.seed + seed_index
        config.unlock()
        config.seed = seed
        config.lock()
        parsed = tuple((f, _lookup(config, f)) for f, _ in point)
        name = run_name(variant, parsed, seed, short)
        try:
          validate_run_config(config)
        except ConfigError as error:
          raise SweepError(f"run {name}: {error}") from None
        if name in names:
          raise SweepError(
              f"runs {names[name]} and {' '.join(grid_overrides) or variant} would share the "
              f"workdir {name}: the grid gives the same config twice; drop a duplicate value.")
        names[name] = " ".join(grid_overrides) or variant
        workdir = join(workdir_root, name)
        runs.append(Run(name=name, variant=variant, point=parsed, seed=seed, config_spec=spec,
                        overrides=tuple([*own_shared, *grid_overrides,
                                                    f"--config.{SEED_FIELD}={seed}"]),
                        workdir=workdir, steps=config.num_train_steps))
        if check_existing:
          _check_existing(workdir, config)
  return runs


def point_runs(config_spec: str, shared: Sequence[str], variant: str, grid_texts: Sequence[str],
               point: Mapping[str, object], seeds: int, workdir_root: str) -> list[Run]:
  """The runs of `variant` at one `point` ({grid field: value}, a value of which may lie beyond
  the grid), named and checked as `build` names and checks the grid's own runs."""
  fields = [field for field, _ in parse_grid(grid_texts)]
  return build(config_spec, shared, [variant], [f"{f}={format_value(point[f])}" for f in fields],
               seeds, workdir_root)


def join(folder: str, name: str) -> str:
  """`folder/name` for a local folder or a gs:// one."""
  return f"{folder.rstrip('/')}/{name}"


def override_text(field: str, value) -> str:
  """`--config.FIELD=VALUE` that ml_collections parses back to `value` (a Python value)."""
  if isinstance(value, (list, tuple)):
    return f"--config.{field}=({','.join(map(str, value))}{',' if len(value) == 1 else ''})"
  return f"--config.{field}={value!r}" if isinstance(value, float) else \
      f"--config.{field}={value}"


def run_for(name: str, config_spec: str, overrides: Mapping[str, object], workdir_root: str,
            *, variant: str | None = None, point: Mapping[str, object] | None = None,
            seed: int | None = None) -> Run:
  """One run named by its caller (an experiment script's own plan), from Python-valued
  overrides: the command's texts parse back to exactly those values, and a workdir of that
  name holds no run of another config; else SweepError."""
  texts = tuple(override_text(field, value) for field, value in overrides.items())
  try:
    config = _parse_config(config_spec, texts)
  except (flags.Error, ValueError, AttributeError, KeyError) as error:
    raise SweepError(f"run {name}: {' '.join(str(error).split())}") from None
  for field, value in overrides.items():
    parsed = _lookup(config, field)
    if (list(parsed) if isinstance(parsed, tuple) else parsed) != (
        list(value) if isinstance(value, tuple) else value):
      raise SweepError(f"run {name}: {field}={value!r} reads back as {parsed!r} on the command "
                       "line; give it as a value ml_collections parses.")
  _check_existing(join(workdir_root, name), config)
  return Run(name=name, variant=variant or config_spec.partition(":")[0],
             point=tuple((point or {}).items()), seed=config.seed if seed is None else seed,
             config_spec=config_spec, overrides=texts, workdir=join(workdir_root, name),
             steps=config.num_train_steps)


def _lookup(config, dotted: str):
  for part in dotted.split("."):
    config = config[part]
  return config


# Fields a run may change between starts of the same run (where its files or compiled programs
# go, how it is restored); the rest must match the workdir's config.json.
_MAY_DIFFER = ("restore_step", "compilation_cache_dir", "storage_retry_budget_s")


def _check_existing(workdir: str, config) -> None:
  """A workdir whose config.json differs from the run's config (in a field set in both) holds
  another run: one line naming the first differing field, before anything starts."""
  path = join(workdir, config_files.CONFIG_FILE)
  if not storage.exists(path):
    return
  saved = dict(config_files.dotted_items(json.loads(storage.read_text(path))))
  for field, value in config_files.dotted_items(config.to_dict()):
    if hasattr(value, "items") or value is None or field in _MAY_DIFFER or field not in saved:
      continue
    old = saved[field]
    if isinstance(value, tuple):
      value = list(value)
    if old is not None and old != value:
      raise SweepError(f"{workdir} holds a run with {field}={old!r}, this sweep asks for "
                       f"{value!r}: give another --workdir_root (or remove that run).")

"""JAX's persistent compilation cache for the train, evaluate and sample commands (docs/training.md,
"Compilation cache"): a restarted run loads its compiled steps instead of compiling them again.

Each entry point calls `enable(*choose(flag, config))` once, before its first compile. The
folder is `--compilation_cache_dir` (all three commands), else the config field
`compilation_cache_dir` (train), else JAX's own `jax_compilation_cache_dir` when set (e.g. by
JAX_COMPILATION_CACHE_DIR), else `$XDG_CACHE_HOME/simplified_flax/jax` (`~/.cache/...`); the
value "off" turns the cache off. Every compiled program is stored, however fast it compiled (a
tiny model compiles in under a second on CPU, JAX's default threshold is 1 s). Every process of
a multi-process run may use the same folder, and a gs:// folder works too (JAX handles both).
"""
import os

from absl import flags
import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from simplified_flax.runs.config_checks import ConfigError

FIELD = "compilation_cache_dir"   # the config field and the flag
OFF = "off"
MIN_COMPILE_TIME_SECS = 0.0       # store every program (JAX's default, 1 s, skips CPU compiles)

_NOT_YET = object()
_enabled = _NOT_YET   # the folder enable() set (None: off)


def define_flag() -> None:
  """`--compilation_cache_dir`, shared by the train, evaluate and sample commands."""
  flags.DEFINE_string(FIELD, None, "Folder of JAX's persistent compilation cache, or 'off' "
                      "(default: the config's compilation_cache_dir, else "
                      "$XDG_CACHE_HOME/simplified_flax/jax or ~/.cache/simplified_flax/jax).")


def default_dir() -> str:
  """`$XDG_CACHE_HOME/simplified_flax/jax`, else `~/.cache/simplified_flax/jax`."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "simplified_flax", "jax")


def choose(flag_value: str | None, config=None) -> tuple[str | None, str]:
  """(value, where it came from): the flag wins over `config.compilation_cache_dir`; evaluate
  and sample pass no config (the run may have trained on another machine)."""
  if flag_value is not None:
    return flag_value, f"--{FIELD}"
  value = config.get(FIELD) if config is not None else None
  return value, f"--config.{FIELD}"


def enable(path_or_none: str | None, where: str = f"--{FIELD}") -> str | None:
  """Turns the cache on in `path_or_none` (None: the default folder) or off ("off"); returns
  the folder (None: off). Idempotent. Raises ConfigError, naming `where` and the fix, for a
  folder that cannot be used (a file, not creatable, not writable); a gs:// folder is not
  checked here."""
  global _enabled
  if path_or_none is not None and path_or_none.strip().lower() == OFF:
    folder = None
  else:
    folder = _folder(path_or_none, where)
  if _enabled == folder:
    return folder
  if folder is None:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if _enabled is not _NOT_YET:   # another folder than before: JAX opens the cache once
    jax_cache.reset_cache()
  _enabled = folder
  return folder


def _folder(value: str | None, where: str) -> str:
  """The folder to use, created if missing; ConfigError when it cannot be."""
  if value is None:
    value = jax.config.jax_compilation_cache_dir or default_dir()
    whose = "JAX's jax_compilation_cache_dir" if jax.config.jax_compilation_cache_dir else \
        "the default"
    shown = f"{FIELD} (unset, so {whose} {value})"
  else:
    shown = f"{where}={value!r}"
  fix = (f"give a writable folder with --{FIELD}=DIR, or --{FIELD}={OFF} to turn the "
         f"compilation cache off.")
  if not value.strip():
    raise ConfigError(f"{shown} is empty: {fix}")
  if "://" in value:
    return value   # a remote folder (gs://...): JAX reads and writes it through etils
  folder = os.path.abspath(os.path.expanduser(value))
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise ConfigError(f"{shown} is a file, not a folder: {fix}")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as error:
    raise ConfigError(f"{shown} cannot be created ({error.strerror}): {fix}") from error
  if not os.access(folder, os.W_OK | os.X_OK):
    raise ConfigError(f"{shown} is not writable: {fix}")
  return folder

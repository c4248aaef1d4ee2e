"""What every command-line entry point shares: flag parsing, start-up, and one-line errors.

An entry point ends with `cli.run(main, "simplified_flax.train")` instead of `app.run(main)`:
a user error prints `<program>: error: <what, where, the fix>`, no traceback (`--verbose` adds
it), and exits 2 (a bad flag or config value) or 1 (any other); a bug keeps its traceback.
"""
import difflib
import errno
import os
import signal
import sys
import traceback
import warnings
from typing import Callable, Sequence

from absl import app
from absl import flags
from absl import logging

from simplified_flax import config_files
from simplified_flax.runs import distributed_failure   # no JAX at import

USAGE_ERROR, OTHER_ERROR = 2, 1
VERBOSE_FLAG = "verbose"
_NO_SPACE_TEXT = ("No space left on device", "[Errno 28]")


class UnknownOverrideError(ValueError):
  """A `--config.<path>=value` whose path names no field of the config."""


def flag_value(argv: Sequence[str], flag: str) -> str | None:
  """The last `--flag=value` of `argv` ("true" for a bare `--flag`), else None."""
  given = [a.split("=", 1)[1] if "=" in a else "true" for a in argv
           if a == f"--{flag}" or a.startswith(f"--{flag}=")]
  return given[-1] if given else None


def start(argv: Sequence[str]) -> flags.FlagValues:
  """Refuses stray positional arguments and, unless `--verbosity` was given, logs warnings and
  errors only (Orbax logs every save at INFO). Returns the parsed flags."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}; every option is a --flag "
                         "(see --help).", exitcode=USAGE_ERROR)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if not (VERBOSE_FLAG in flags.FLAGS and flags.FLAGS[VERBOSE_FLAG].value):
    logging.get_absl_handler().addFilter(_drop_orbax_background_tracebacks)
    _drop_closed_loop_reports()
  return flags.FLAGS


def _drop_orbax_background_tracebacks(record) -> bool:
  """Drops log records whose traceback passes through Orbax: its save threads log a failed
  write (a full disk: 300 lines) that `run` prints as one line."""
  if not record.exc_info or record.exc_info[2] is None:
    return True
  paths = [record.pathname] + [f.filename for f in traceback.extract_tb(record.exc_info[2])]
  return not any(f"{os.sep}orbax{os.sep}" in path for path in paths)


def _drop_closed_loop_reports() -> None:
  """After such a failed write, tensorstore's callbacks still post to the event loop Orbax has
  closed: their reports ("Event loop is closed"), raised or unraisable, are dropped."""
  def unless_closed(hook, error_of):
    def filtered(*args):
      error = error_of(*args)
      if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        hook(*args)
    return filtered
  sys.excepthook = unless_closed(sys.excepthook, lambda kind, value, tb: value)
  sys.unraisablehook = unless_closed(sys.unraisablehook, lambda report: report.exc_value)


def exit_on_sigterm() -> None:
  """Until the training loop installs its own handler, SIGTERM exits 0 with one line; entry
  points call this before their slow imports."""
  def stop(signum, frame):
    del signum, frame
    print("Stopped by SIGTERM outside the training loop: every completed checkpoint stays; "
          "rerun the same command to resume.", file=sys.stderr, flush=True)
    lock = sys.modules.get("simplified_flax.runs.workdir_lock")
    if lock is not None:
      lock.release_held()
    # Not SystemExit: unwinding an import or a start-up call in progress could crash Python
    # or wait on its threads; nothing before the first step needs saving.
    os._exit(0)
  signal.signal(signal.SIGTERM, stop)


def run(main: Callable[[list[str]], None], program: str) -> None:
  """`app.run(main)` with the flags parsed by `parse_flags` and user errors as one line."""
  if VERBOSE_FLAG not in flags.FLAGS:
    flags.DEFINE_bool(VERBOSE_FLAG, False, "Print the traceback of a user error too.")
  verbose = (flag_value(sys.argv, VERBOSE_FLAG) or "false").lower() in ("true", "1")
  try:
    app.run(main, flags_parser=parse_flags)
  except SystemExit as done:
    if not done.code:
      distributed_failure.mark_done()
    raise
  except Exception as error:  # pylint: disable=broad-except
    lost = distributed_failure.explain(error_chain(error))
    status = exit_status(error)
    if lost is None and status is None:
      raise   # a bug: keep the traceback
    if verbose:
      traceback.print_exc()
    # Coroutines of a failed background save (Orbax), never awaited: a warning each at exit.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
    if lost is not None:
      distributed_failure.stop(lost, program)   # one line, status 1
    print(f"{program}: error: {one_line(error)}"
          + ("" if verbose else " (--verbose shows the traceback)"), file=sys.stderr, flush=True)
    if _store_down(error) or (is_disk_full(error) and not verbose):
      # Orbax's background saves are still failing (a full disk) or waiting on the dead store
      # (minutes, in threads that are not daemons): an interpreter shutdown would wait for them
      # or print their reports after the line above. What completed is durable already and
      # the step being written is discarded anyway, so leave now, releasing the lock as a
      # normal exit would.
      lock = sys.modules.get("simplified_flax.runs.workdir_lock")
      if lock is not None:
        lock.release_held()
      sys.stdout.flush()
      os._exit(status)   # pylint: disable=protected-access
    sys.exit(status)


def _store_down(error: BaseException) -> bool:
  from simplified_flax.retries import StoreUnavailableError  # pylint: disable=import-outside-toplevel
  return any(isinstance(e, StoreUnavailableError) for e in error_chain(error))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing; a mistyped config field is an UnknownOverrideError, else a usage error."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    raise app.UsageError(str(error), exitcode=USAGE_ERROR) from error
  except (AttributeError, KeyError) as error:
    unknown = unknown_override(argv)
    if unknown is not None:
      raise unknown from error
    raise app.UsageError(f"{error}", exitcode=USAGE_ERROR) from error


def unknown_override(argv: Sequence[str]) -> UnknownOverrideError | None:
  """The error for the first `--<config flag>.<path>=...` of `argv` whose path is no field of
  that flag's config, with the closest existing field (difflib) as the fix."""
  for flag_name, config in _config_flags(argv):
    fields = sorted(path for path, _ in config_files.dotted_items(config))
    prefix = f"--{flag_name}."
    for path in [a[len(prefix):].split("=", 1)[0] for a in argv if a.startswith(prefix)]:
      if path in fields:
        continue
      close = difflib.get_close_matches(path, fields, n=1, cutoff=0.6)
      fix = (f"did you mean --{flag_name}.{close[0]}?" if close else
             "see the config file for the field names.")
      return UnknownOverrideError(f"--{flag_name}.{path}: the config has no field '{path}'; "
                                  f"{fix}")
  return None


def _config_flags(argv: Sequence[str]):
  """(name, loaded ConfigDict) of every ml_collections config flag named in `argv`."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  for name, flag in flags.FLAGS._flags().items():  # pylint: disable=protected-access
    if "." in name or not any(a.startswith(f"--{name}.") for a in argv):
      continue
    given = flag_value(argv, name)
    try:
      config = flag.parser.parse(given if given is not None else flag.default)
    except Exception:  # pylint: disable=broad-except
      continue   # the config file itself does not load: absl's own message says why
    if isinstance(config, ml_collections.ConfigDict):
      yield name, config


def error_chain(error: BaseException):
  """`error`, its causes and contexts, and the members of exception groups, each once."""
  seen, todo = set(), [error]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    yield e
    todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])


def is_disk_full(error: BaseException) -> bool:
  """Whether ENOSPC appears anywhere in the chain (Orbax wraps it in its own errors)."""
  return any((isinstance(e, OSError) and e.errno == errno.ENOSPC)
             or any(text in str(e) for text in _NO_SPACE_TEXT) for e in error_chain(error))


def _user_error_types():
  # Imported here: this module is imported before JAX, for the start-up SIGTERM handler.
  # pylint: disable=import-outside-toplevel
  from simplified_flax.aot import targets
  from simplified_flax.authors import ConversionError
  from simplified_flax.data.errors import DataError
  from simplified_flax.retries import StoreUnavailableError
  from simplified_flax.runs import checkpoints
  from simplified_flax.runs import compatibility
  from simplified_flax.runs import nonfinite
  from simplified_flax.runs import workdir_lock
  from simplified_flax.runs.config_checks import ConfigError
  from simplified_flax.sweeps.plan import SweepError
  usage = (ConfigError, UnknownOverrideError, app.UsageError, targets.TargetError,
           targets.MissingBackendError, SweepError)
  other = (DataError, targets.DoesNotFitError, ConversionError,
           compatibility.IncompatibleCheckpointError, checkpoints.CheckpointError,
           checkpoints.WorkdirError, workdir_lock.WorkdirLockedError,
           nonfinite.NonFiniteLossError, distributed_failure.PeerLostError,
           StoreUnavailableError)
  return usage, other


def exit_status(error: BaseException) -> int | None:
  """2 for a usage error, 1 for another user-input or environment error, None for a bug."""
  usage, other = _user_error_types()
  if isinstance(error, usage):
    return USAGE_ERROR
  if isinstance(error, other) or is_disk_full(error):
    return OTHER_ERROR
  return None


def one_line(error: BaseException) -> str:
  """The message of `error` on one line (a full disk gets its own message and fix)."""
  if is_disk_full(error) and not isinstance(error, _user_error_types()[1]):
    where = next((getattr(e, "filename", None) for e in error_chain(error)
                  if getattr(e, "filename", None)), None)
    return ("No space left on device" + (f" writing {where}" if where else "") + ". Free space "
            "and rerun the same command: it resumes from the last complete checkpoint (a "
            "step that was being written is discarded).")
  text = str(error.args[0]) if len(error.args) == 1 else str(error)
  return " ".join(text.split())

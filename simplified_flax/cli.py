"""What every command-line entry point does first, after absl has parsed the flags."""
from typing import Sequence

from absl import app
from absl import flags
from absl import logging


def start(argv: Sequence[str]) -> flags.FlagValues:
  """Refuses stray positional arguments (a flag typed without `--`) and, unless `--verbosity`
  was given, logs warnings and errors only: Orbax logs every save and restore at INFO, which
  would bury the progress lines. Returns the parsed flags."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}; every option is a --flag "
                         "(see --help).")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  return flags.FLAGS

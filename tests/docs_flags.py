"""The command-line flags of entry points, read from their own help, for tests/test_docs_*.py:

    python tests/docs_flags.py simplified_flax.train experiments/benchmark.py ...

prints one JSON object {program: [flag, ...]}. Each program runs as `__main__` with
`--helpfull` (absl; `--help` for argparse scripts) in a child forked from this process once
JAX, Flax, Orbax and absl are imported, so that twenty entry points cost one import of them.
A boolean absl flag `--[no]x` gives `x` and `nox`.
"""
import json
import os
import re
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _help_text(program: str, argument: str) -> str:
  """What `python -m program argument` (or `python program argument`) prints."""
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:   # the child: run the entry point as a script, its output into the pipe
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write, 2)
    status = 0
    try:
      if program.endswith(".py"):
        path = os.path.join(REPO, program)
        sys.argv = [path, argument]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")
      else:
        sys.argv = [program, argument]
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    except SystemExit as done:
      status = done.code if isinstance(done.code, int) else 0
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(status or 0)   # pylint: disable=protected-access
  os.close(write)
  chunks = []
  while chunk := os.read(read, 1 << 16):
    chunks.append(chunk)
  os.close(read)
  os.waitpid(pid, 0)
  return b"".join(chunks).decode(errors="replace")


def flags_of(program: str) -> list[str]:
  text = _help_text(program, "--helpfull")
  if "--[no]helpfull" not in text:          # not absl: argparse's help
    text = _help_text(program, "--help")
  names = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*)(?![\w-])", text))
  for boolean in re.findall(r"--\[no\]([a-z][a-z0-9_]*)", text):
    names.update({boolean, "no" + boolean})
  if not names:
    raise SystemExit(f"{program}: no flags in its help:\n{text[-2000:]}")
  return sorted(names)


def main(programs: list[str]) -> None:
  sys.path.insert(0, REPO)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Imported once here, so that each forked child starts with them loaded.
  import jax  # pylint: disable=unused-import,import-outside-toplevel
  import flax.linen  # pylint: disable=unused-import,import-outside-toplevel
  import optax  # pylint: disable=unused-import,import-outside-toplevel
  import orbax.checkpoint  # pylint: disable=unused-import,import-outside-toplevel
  from absl import app  # pylint: disable=unused-import,import-outside-toplevel
  print(json.dumps({program: flags_of(program) for program in programs}))


if __name__ == "__main__":
  main(sys.argv[1:])

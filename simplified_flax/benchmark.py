"""`python -m simplified_flax.benchmark --configs=...`: the throughput benchmark.

A measuring tool kept beside the experiments: this runs the source checkout's
`experiments/benchmark.py` (flags and figures: there and in docs/benchmark.md) with the same argv.
"""
import pathlib
import runpy
import shlex
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "benchmark.py"


def main(script: pathlib.Path = SCRIPT) -> None:
  """Runs `script` as `__main__` with this command line; without it (an installed package
  has no experiments/), one line saying what to run instead, and exit status 2."""
  if not script.is_file():
    command = shlex.join(["python", "experiments/benchmark.py", *sys.argv[1:]])
    print(f"simplified_flax.benchmark: error: the benchmark ships with the source checkout "
          f"({script} does not exist); in a clone of the repository run: {command}",
          file=sys.stderr)
    sys.exit(2)
  runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
  main()

"""Explicit vs fused attention, paired in one process: which path should `attention_impl="auto"`
take on this backend?

    python experiments/attention_paths.py                       # preln, sas_p at the benchmark shape
    python experiments/attention_paths.py --configs=preln,sas,sas_p --rounds=6

Every (config, path) pair is a `benchmark.Runner` at `benchmark.BENCH_SHAPE` (D=768, L=6, T=128,
batch 8), timed round-robin by `benchmark.measure`, so machine drift hits every pair alike. The
table's ratios are to the first config on the explicit path; the last line of stdout is the JSON.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simplified_flax import benchmark  # pylint: disable=g-import-not-at-top

IMPLS = ("explicit", "fused")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="preln,sas_p")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  runners = [benchmark.Runner(f"{spec}/{impl}", benchmark.load_config(
      spec, {"model.attention_impl": impl, "dtype": args.dtype}))
             for spec in args.configs.split(",") for impl in IMPLS]
  results = benchmark.measure(runners, args.rounds, args.steps)
  print(benchmark.table(results))
  print(json.dumps({name: {k: r[k] for k in ("step_time_s", "speedup_paired", "compile_s")}
                    for name, r in results.items()}))


if __name__ == "__main__":
  main()

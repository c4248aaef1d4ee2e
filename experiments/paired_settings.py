"""Settings of one config field, paired in one process: which is faster on this backend?

    python experiments/paired_settings.py --vary=model.attention_impl=explicit,fused
    python experiments/paired_settings.py --vary=model.scan_layers=False,True --configs=sas_p
    python experiments/paired_settings.py --vary=model.attention_impl=explicit,fused \
        --set=dtype=\'bfloat16\' --rounds=10

Every (config, setting) pair is a `benchmark.Runner` (benchmark.py) at `BENCH_SHAPE` (D=768,
L=6, T=128, batch 8) plus the `--set` overrides, timed round-robin by `benchmark.measure`, so
machine drift hits every pair alike. The table's ratios are paired ratios to the first pair
(first config, first setting); the last line of stdout is one JSON object.
"""
import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import report_lib  # pylint: disable=g-import-not-at-top
from experiments import benchmark  # pylint: disable=g-import-not-at-top


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vary", required=True, help="FIELD=VALUE,VALUE,... (Python literals)")
  parser.add_argument("--configs", default="preln,sas_p")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=1)
  args = parser.parse_args()
  field, _, values = args.vary.partition("=")
  overrides = report_lib.parse_overrides(args.set)
  literal = lambda text: ast.literal_eval(text) if text[:1].isdigit() or text in (
      "True", "False", "None") else text
  runners = [benchmark.Runner(f"{spec}/{value}", benchmark.load_config(
      spec, {**overrides, field: literal(value)}))
             for spec in args.configs.split(",") for value in values.split(",")]
  results = benchmark.measure(runners, args.rounds, args.steps)
  print(benchmark.table(results))
  print(json.dumps({name: {k: r[k] for k in ("step_time_s", "speedup_paired", "compile_s",
                                              "memory_bytes")}
                    for name, r in results.items()}))


if __name__ == "__main__":
  main()

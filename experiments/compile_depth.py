"""Compile to first step against depth, with and without `model.scan_layers`.

    python experiments/compile_depth.py                      # SAS-P, D=128, L=18 and 72, CPU
    python experiments/compile_depth.py --scale=paper        # D=768, bfloat16, GPT-2 vocabulary

For each variant, depth and scan setting, `compile_seconds` times one fresh train state and the
first jitted `train_step` (the benchmark's shape and random batch, experiments/benchmark.py):
model init (jitted), lowering, XLA compilation and the first step's run, as a user waits for
them. A one-layer model of the same variant compiles first, so backend start-up is counted in
no depth. `<output>/` gets `report.md` and `results.json`; the deepest-to-shallowest ratio is
the figure that should stay <= 2 with the scan on.
"""
import os
import sys
import time
from typing import Any, Dict, Iterable, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top

from experiments import benchmark  # pylint: disable=g-import-not-at-top
from experiments import report_lib  # pylint: disable=g-import-not-at-top
from simplified_flax.training.step import (  # pylint: disable=g-import-not-at-top
    create_train_state, train_step)

SCALES = {
    "cpu": {"depths": (18, 72), "overrides": {"model.n_embd": 128, "model.n_head": 4}},
    "paper": {"depths": (18, 72), "overrides": {"dtype": "bfloat16",
                                                "model.vocab_size": 50257}},
}
SCAN_SETTINGS = (False, True)


def _first_step_seconds(config) -> float:
  """Seconds from nothing to the first step's metrics: init, lower, compile, run."""
  start = time.perf_counter()
  state = create_train_state(config, jax.random.PRNGKey(config.seed))
  batch = benchmark.random_batch(config, jax.random.PRNGKey(1))
  _, metrics = jax.jit(train_step, donate_argnums=0)(state, batch)
  jax.block_until_ready(metrics)
  return time.perf_counter() - start


def compile_seconds(spec: str, overrides: Mapping[str, Any],
                    depths: Iterable[int]) -> Dict[int, float]:
  """{depth: seconds to the first train step} of config `spec` (as `benchmark.load_config`)
  with `overrides` (e.g. {"model.scan_layers": True}) at each depth, in this process."""
  _first_step_seconds(benchmark.load_config(spec, {**overrides, "model.n_layer": 1}))
  return {depth: _first_step_seconds(benchmark.load_config(
      spec, {**overrides, "model.n_layer": depth})) for depth in depths}


def report(rows, command: str) -> str:
  shallow, deep = min(rows[0]["seconds"]), max(rows[0]["seconds"])
  table = "\n".join(report_lib.markdown_table(
      ["variant", "scan_layers", f"L={shallow}", f"L={deep}", f"L={deep} / L={shallow}"],
      [[r["variant"], r["scan_layers"], f"{r['seconds'][shallow]:.1f} s",
        f"{r['seconds'][deep]:.1f} s", f"{r['seconds'][deep] / r['seconds'][shallow]:.2f}x"]
       for r in rows]))
  return (f"# Compile to first step against depth\n\n    {command}\n\n"
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}. Seconds from a fresh train "
          f"state to the first step's metrics (init, lowering, compilation, one step), one "
          f"run each on a shared machine.\n\n{table}\n")


def main() -> None:
  parser = report_lib.experiment_parser("compile_depth", __doc__, SCALES, ("sas_p",),
                                        workdirs=False, report_only=False)
  args = parser.parse_args()
  scale = SCALES[args.scale]
  output, _ = report_lib.output_folders(args, "compile_depth")
  overrides = {**scale["overrides"], **report_lib.parse_overrides(args.set)}
  rows = []
  for variant in args.variants.split(","):
    for scan in SCAN_SETTINGS:
      seconds = compile_seconds(variant, {**overrides, "model.scan_layers": scan},
                                scale["depths"])
      rows.append({"variant": variant, "scan_layers": scan, "seconds": seconds})
      print(f"{variant} scan_layers={scan}: " + ", ".join(
          f"L={d} {s:.1f}s" for d, s in seconds.items()), flush=True)
  command = report_lib.command_line("compile_depth", args, parser, ("variants",))
  text = report(rows, command)
  print(text)
  report_lib.write_report(output, text, {"command": command, "jax": jax.__version__,
                                         "device": jax.devices()[0].device_kind,
                                         "overrides": overrides, "rows": rows})


if __name__ == "__main__":
  main()

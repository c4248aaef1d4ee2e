"""The benchmark on an accelerator this host lacks (`benchmark.py --target=NAME`), and the
roofline of a benchmarked step on the device it ran on: figures read from compiled programs
(simplified_flax/aot), estimates, not timings."""
from typing import Any, Dict

import jax

from experiments import step_breakdown
from simplified_flax.aot import hlo_costs
from simplified_flax.aot import programs
from simplified_flax.aot import report
from simplified_flax.aot import targets


def compiled_rooflines(specs, overrides: dict, target_name: str, breakdown: bool,
                       load_config) -> Dict[str, Dict[str, Any]]:
  """Each config compiled for `target_name` (no device): its compile report, printed, with
  the roofline ratio to the first config and, with `breakdown`, its parts' roofline.
  `load_config(spec, overrides)` is the benchmark's (its shape under the overrides)."""
  target = targets.parse(target_name)
  results = {}
  for spec in specs:
    compiled = programs.compile_for(load_config(spec, overrides), target)
    results[spec] = report.summarize(compiled, compiled.config)
    ratio = next(iter(results.values()))["roofline_step_s"] / results[spec]["roofline_step_s"]
    print(f"{spec} (x{ratio:.3f} the first config's roofline speed)\n"
          f"{report.text(results[spec])}\n", flush=True)
    if breakdown:
      program = hlo_costs.parse(compiled.train.as_text())
      parts = step_breakdown.roofline_breakdown(program, target.device.peak_flops,
                                                target.device.hbm_bytes_per_s)
      results[spec]["breakdown"] = parts
      print(step_breakdown.table(spec, parts, parts["op_time_s"]) + "\n", flush=True)
  return results


def roofline_here(compiled) -> float | None:
  """The roofline of `compiled` on this host's device, if the target table has it."""
  device = targets.device_of_kind(jax.devices()[0].device_kind)
  if device is None:
    return None
  program = hlo_costs.parse(compiled.as_text())
  return hlo_costs.roofline_seconds(program, device.peak_flops, device.hbm_bytes_per_s)

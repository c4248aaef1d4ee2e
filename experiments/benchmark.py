"""Training throughput of several configs, measured round-robin in one process.

    python experiments/benchmark.py --configs=preln,sas,sas_p \
        --config.model.attention_impl=fused
    python experiments/benchmark.py --configs=preln --config.model.n_embd=256 \
        --config.model.n_head=8 --batch_size=16 --breakdown

Configs are variant files of `configs/` (`name` or `name:arg`); every `--config.*` override
applies to each of them, after BENCH_SHAPE (the paper's width, 6 layers, batch 8, the byte
vocabulary: a few minutes on a CPU). `python -m simplified_flax.benchmark` runs this script.

What is timed: `train_step` (forward, backward, clipping, AdamW) jitted with the state donated,
on one fixed batch of random tokens, compiled ahead of time (compile seconds reported apart)
and run once before timing. Each round runs `--steps` steps of every config in turn, then
times one [n, n] `jnp.dot` in the compute dtype: the matmul peak this machine reaches right
now. Figures are medians over rounds; the ratios (`speedup_paired`) are medians of the ratios
within each round, which a busy, shared machine disturbs far less than a ratio of medians.

  * flops_per_token  6 N + 12 L T D: N the matmul weights (every `kernel`, plus the V x D tied
    head), 12 L T D the attention scores and weighted values, forward and backward, over the
    whole T x T square. Norms, softmax, gains and the optimiser are not counted.
  * mfu              flops_per_token * tokens/s / measured matmul peak (same dtype); on a GPU
    or TPU also `mfu_nominal`, against the device's published dense peak.
  * memory_bytes     XLA's buffers for the step (arguments + temporaries + outputs - donated
    aliases); the process's peak (device `peak_bytes_in_use`, else peak RSS) is shared by all.

`--breakdown` then prints each config's step by part (step_breakdown.py). The last line of
stdout is one JSON object keyed by config.
"""
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simplified_flax import cli  # pylint: disable=g-import-not-at-top  (no JAX at import)
from simplified_flax.aot import targets  # pylint: disable=g-import-not-at-top  (likewise)

if __name__ == "__main__" and cli.flag_value(sys.argv, "target"):
  targets.prepare_environment()   # before JAX: compile for the target, run nothing here

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

import configs  # pylint: disable=g-import-not-at-top
from experiments import compiled_benchmark  # pylint: disable=g-import-not-at-top
from experiments import step_breakdown  # pylint: disable=g-import-not-at-top
from simplified_flax.aot.report import flops_per_token  # pylint: disable=g-import-not-at-top
from simplified_flax.model import parameters  # pylint: disable=g-import-not-at-top
from simplified_flax.training.step import (  # pylint: disable=g-import-not-at-top
    create_train_state, train_step)

# The benchmark's shape, applied before the command line's overrides.
BENCH_SHAPE = {"model.n_layer": 6, "model.n_embd": 768, "model.n_head": 12,
               "model.context_length": 128, "model.vocab_size": 256, "batch_size": 8}
# Published dense peaks, FLOP/s: (bfloat16, float32 at JAX's default matmul precision).
NOMINAL_PEAKS = {
    "TPU v4": (275e12, 275e12), "TPU v5 lite": (197e12, 197e12), "TPU v5p": (459e12, 459e12),
    "TPU v6 lite": (918e12, 918e12), "A100": (312e12, 156e12), "H100": (989e12, 494e12),
    "H200": (989e12, 494e12), "L4": (121e12, 60e12),
}


def with_flag(overrides: dict, field: str, flag_value) -> dict:
  """`overrides` with a dedicated flag folded into the config field it stands for (e.g.
  `--batch_size`): never a silent winner, a disagreement is a usage error."""
  if flag_value is not None and overrides.get(field, flag_value) != flag_value:
    raise app.UsageError(f"--{field}={flag_value} and --config.{field}={overrides[field]} "
                         "disagree: give one of them.", exitcode=cli.USAGE_ERROR)
  return overrides if flag_value is None else dict(overrides, **{field: flag_value})


def load_config(spec: str, overrides: Dict[str, Any]):
  """configs/<name>.py (`name` or `name:arg`) with the benchmark shape, then `overrides`."""
  return configs.load(spec, dict(BENCH_SHAPE, **overrides))


def random_batch(config, rng) -> Dict[str, Any]:
  """A decoder batch {"inputs"} or an encoder batch (+ "targets", 15% "weights") [B, T]."""
  shape = (config.batch_size, config.model.context_length)
  tokens_BT = jax.random.randint(rng, shape, 0, config.model.vocab_size, jnp.int32)
  if config.model.kind == "decoder":
    return {"inputs": tokens_BT}
  weights_BT = jax.random.bernoulli(jax.random.fold_in(rng, 1), 0.15, shape)
  return {"inputs": tokens_BT, "targets": tokens_BT, "weights": weights_BT.astype(jnp.float32)}


def memory_bytes(compiled) -> int:
  """Arguments + temporaries + outputs - donated aliases of a compiled step (XLA's estimate)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return 0
  return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes +
             stats.output_size_in_bytes - stats.alias_size_in_bytes)


def process_peak_memory() -> Dict[str, Any]:
  stats = jax.devices()[0].memory_stats() or {}   # device stats where the backend has them
  if "peak_bytes_in_use" in stats:
    return {"bytes": int(stats["peak_bytes_in_use"]), "source": "device peak_bytes_in_use"}
  return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "source": "process peak RSS"}


class Runner:
  """One config's state, batch and ahead-of-time compiled step."""

  def __init__(self, spec: str, config):
    self.name, self.config = spec, config
    self.state = create_train_state(config, jax.random.PRNGKey(config.seed))
    self.counts = parameters.counts({"params": self.state.params, **self.state.constants})
    self.batch = random_batch(config, jax.random.PRNGKey(1))
    self.flops = flops_per_token(config, self.state.params)
    self.tokens_per_step = config.batch_size * config.model.context_length
    start = time.perf_counter()
    self.step = jax.jit(train_step, donate_argnums=0).lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.memory = memory_bytes(self.step)
    cost = self.step.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    self.xla_flops_per_token = float(cost.get("flops", 0.0)) / self.tokens_per_step
    self.run(1)   # first execution allocates; never timed
    self.times: List[float] = []

  def run(self, steps: int) -> float:
    """Seconds per step over `steps` steps, blocking on the last state."""
    start = time.perf_counter()
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return (time.perf_counter() - start) / steps


def matmul_peak(dtype, n: int):
  """A callable that times one [n,n]@[n,n] dot and returns FLOP/s (compiled and warm)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
  dot = jax.jit(jnp.dot).lower(a, b).compile()
  dot(a, b).block_until_ready()

  def measure(reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
      start = time.perf_counter()
      dot(a, b).block_until_ready()
      best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best

  return measure


def nominal_peak(dtype_name: str):
  kind = jax.devices()[0].device_kind.lower()
  for key, (bf16, f32) in NOMINAL_PEAKS.items():
    if key.lower() in kind:
      return bf16 if dtype_name in ("bfloat16", "float16") else f32
  return None


def measure(runners: List[Runner], rounds: int, steps: int,
            matmul_size: int = 0) -> Dict[str, Dict[str, Any]]:
  """`summarise`'s results of `rounds` rounds, one line printed per round: each round runs
  `steps` steps of every runner in turn, then times the [n, n] matmul peak in the first
  runner's dtype (n = `matmul_size`; 0: 2048 on CPU, 8192 on accelerators)."""
  dtype_name = runners[0].config.dtype
  on_cpu = jax.devices()[0].platform == "cpu"
  measure_peak = matmul_peak(jnp.dtype(dtype_name), matmul_size or (2048 if on_cpu else 8192))
  peaks = []
  for round_index in range(rounds):
    # Each round starts one config later, so no config always follows the matmul probe.
    start = round_index % len(runners)
    for r in runners[start:] + runners[:start]:
      r.times.append(r.run(steps))
    peaks.append(measure_peak())
    print(f"round {round_index + 1}/{rounds}: " + ", ".join(
        f"{r.name} {1e3 * r.times[-1]:.0f}ms" for r in runners) +
          f", matmul {peaks[-1] / 1e9:.0f} GFLOP/s", flush=True)
  return summarise(runners, peaks, nominal_peak(dtype_name))


def summarise(runners: List[Runner], peaks: List[float], nominal) -> Dict[str, Dict[str, Any]]:
  process = process_peak_memory()
  peak = statistics.median(peaks)
  results = {}
  for r in runners:
    step_s = statistics.median(r.times)
    # Paired: both steps of a round saw about the same machine load.
    speedup = statistics.median(a / b for a, b in zip(runners[0].times, r.times))
    tokens_per_s = r.tokens_per_step / step_s
    achieved = r.flops["flops_per_token"] * tokens_per_s
    m = r.config.model
    roofline_s = compiled_benchmark.roofline_here(r.step)
    results[r.name] = {
        "params_total": r.counts["total"], "params_trainable": r.counts["trainable"],
        "params_non_embedding": r.counts["non_embedding"],
        "step_time_s": step_s, "step_time_min_s": min(r.times),
        "step_time_rounds_s": r.times, "tokens_per_sec": tokens_per_s,
        "speedup_paired": speedup,
        "ratios": {"step_time_s": 1 / speedup, "tokens_per_sec": speedup},
        "compile_s": r.compile_s, "flops_per_token": r.flops["flops_per_token"],
        "xla_flops_per_token": r.xla_flops_per_token, "achieved_flops_per_s": achieved,
        "matmul_peak_flops_per_s": peak, "mfu": achieved / peak,
        "mfu_nominal": achieved / nominal if nominal else None,
        "memory_bytes": r.memory, "memory_source": "XLA buffer assignment of the step",
        "process_peak_memory_bytes": process["bytes"],
        "process_peak_memory_source": process["source"],
        "batch_size": r.config.batch_size, "seq_len": m.context_length, "n_layer": m.n_layer,
        "n_embd": m.n_embd, "vocab_size": m.vocab_size, "dtype": r.config.dtype,
        "attention_impl": m.attention_impl,
        # On a GPU/TPU of aot/targets.py's table: the compiled program's roofline, and how far
        # the measured step is from it (calibrates `python -m simplified_flax.compile`).
        "roofline_step_s": roofline_s,
        "measured_over_roofline": step_s / roofline_s if roofline_s else None,
    }
  return results


COLUMNS = (  # (header, key, scale, format)
    ("params", "params_trainable", 1e-6, "{:.2f}M"),
    ("non-emb", "params_non_embedding", 1e-6, "{:.2f}M"),
    ("step", "step_time_s", 1e3, "{:.0f}ms"),
    ("tokens/s", "tokens_per_sec", 1, "{:.0f}"),
    ("GFLOP/tok", "flops_per_token", 1e-9, "{:.3f}"),
    ("MFU", "mfu", 100, "{:.1f}%"),
    ("memory", "memory_bytes", 2**-20, "{:.0f}MiB"),
    ("compile", "compile_s", 1, "{:.1f}s"),
)


def table(results: Dict[str, Dict[str, Any]]) -> str:
  """Every column as `value (ratio to the first config)`; a config's own `ratios` (the paired
  timing ratios) take precedence over the ratio of the two values."""
  ref = next(iter(results.values()))
  rows = [["config"] + [c[0] for c in COLUMNS]]
  for name, result in results.items():
    row = [name]
    for _, key, scale, fmt in COLUMNS:
      value, base = result[key], ref[key]
      ratio = result.get("ratios", {}).get(key, value / base if base else None)
      row.append(fmt.format(value * scale) + ("" if ratio is None else f" (x{ratio:.3f})"))
    rows.append(row)
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def define_flags():
  """The command's flags; defined only when run as a command, so that importing this module
  (tests, other experiments) never clashes with another module's `--config`."""
  return {
      "configs": flags.DEFINE_list("configs", ["preln", "sas", "sas_p"], "Variant files of "
                                   "configs/ (name or name:arg); the first is the reference."),
      "batch_size": flags.DEFINE_integer("batch_size", None, "= --config.batch_size (8)."),
      "steps": flags.DEFINE_integer("steps", 1, "Timed steps of each config per round."),
      "rounds": flags.DEFINE_integer("rounds", 10, "Rounds over all configs."),
      "breakdown": flags.DEFINE_bool("breakdown", False, "Also profile each config's step "
                                     "and print the time, FLOPs and bytes of its parts."),
      "matmul_size": flags.DEFINE_integer("matmul_size", 0, "n of the peak [n,n]@[n,n] dot; "
                                          "0: 2048 on CPU, 8192 on accelerators."),
      "target": flags.DEFINE_string("target", None, "Compile for this accelerator instead of "
                                    "timing here (simplified_flax.compile's names): the "
                                    "roofline of each config, by part with --breakdown."),
      "xla_flags": flags.DEFINE_string("xla_flags", "", "Appended to XLA_FLAGS before JAX "
                                       "starts its backend."),
      "config": config_flags.DEFINE_config_file(
          "config", os.path.join(os.path.dirname(configs.__file__), "base.py"),
          "Only its `--config.*` overrides are used: they apply to every benchmarked config."),
  }


def main(argv, flag):
  del argv
  if flag["xla_flags"].value:   # read when the first computation starts the backend
    extra = flag["xla_flags"].value
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip()
  overrides = with_flag(dict(config_flags.get_override_values(flags.FLAGS["config"])),
                        "batch_size", flag["batch_size"].value)
  if flag["target"].value:
    print(json.dumps(compiled_benchmark.compiled_rooflines(
        flag["configs"].value, overrides, flag["target"].value, flag["breakdown"].value,
        load_config)))
    return
  runners = [Runner(spec, load_config(spec, overrides)) for spec in flag["configs"].value]
  rounds, steps = flag["rounds"].value, flag["steps"].value
  results = measure(runners, rounds, steps, flag["matmul_size"].value)
  first = results[runners[0].name]
  print(f"\n{jax.devices()[0].device_kind} ({jax.device_count()} device(s)), "
        f"{first['dtype']}; B={first['batch_size']} T={first['seq_len']} L={first['n_layer']} "
        f"D={first['n_embd']} V={first['vocab_size']}; median of {rounds} rounds x "
        f"{steps} steps; matmul peak {first['matmul_peak_flops_per_s'] / 1e9:.0f} "
        f"GFLOP/s (median); process peak memory {first['process_peak_memory_bytes'] / 2**20:.0f}"
        f" MiB ({first['process_peak_memory_source']})")
  print(table(results) + "\n")
  if flag["breakdown"].value:
    step_breakdown.add_breakdowns(runners, results)
  print(json.dumps(results))


if __name__ == "__main__":
  _FLAGS = define_flags()
  cli.run(lambda argv: main(argv, _FLAGS), "experiments/benchmark.py")

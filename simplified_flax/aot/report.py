"""What a compiled step says: memory per device, FLOPs, bytes and a roofline bound.

    summary = report.summarize(compiled, config)   # a JSON-able dict (keys: KEYS)
    print(report.text(summary))                    # a few lines for people

Every figure is read from the compiled program, so it is exact for that program and the same
on every run, and none of it is a timing:
  * memory: XLA's buffer assignment (`memory_analysis()`). The arguments are split by what
    they hold (parameters, optimizer state, batch) from their per-device shard shapes; the
    step needs arguments + temporaries + outputs - donated aliases + code. `fits` compares
    that with the device's memory (targets.DEVICES; a TPU compiler checks it itself).
  * flops_per_device, bytes_per_device: per kernel from the optimized HLO (hlo_costs.py),
    one rule for TPU and NVIDIA programs. Bytes are each kernel's operands and results: the
    traffic of a machine without caches, an upper bound on HBM traffic.
  * collective_bytes_per_device: {kind: bytes} the step's collectives reduce or gather
    between devices (collectives.py), the link traffic the roofline leaves out.
  * roofline_step_s: the sum over kernels of max(FLOPs / peak, bytes / HBM bandwidth), the
    device's published figures; tokens_per_s_bound and mfu_bound follow from it. A measured
    step is slower: kernels do not reach both ceilings, launches and collectives cost time.
"""
import datetime
import importlib.metadata
import re
from typing import Any

import jax
import numpy as np

from simplified_flax.aot import collectives
from simplified_flax.aot import hlo_costs
from simplified_flax.aot import targets
from simplified_flax.fast import attention_kernels
from simplified_flax.fast import grad_rules
from simplified_flax.fast import plan as fast_plan

KEYS = ("target", "devices", "hosts", "mesh", "fast_path", "attention_kernel", "attention_note",
        "memory_per_device_bytes", "device_memory_bytes", "fits", "flops_per_device",
        "bytes_per_device", "non_matmul_bytes_per_device", "collective_bytes_per_device",
        "roofline_step_s", "tokens_per_s_bound", "mfu_bound", "compile_s")
_KERNEL_MARKS = (("splash", re.compile(r"splash_mha")),
                 ("cudnn", re.compile(r"__cudnn\$fmha")))


def flops_per_token(config, params) -> dict[str, int]:
  """The model FLOPs of one trained token, the numerator of MFU: 6 N + 12 L T D, N the matmul
  weights (every `kernel`, plus the V x D tied head), 12 L T D the attention scores and
  weighted values, forward and backward, over the whole T x T square. Norms, softmax, gains
  and the optimizer are not counted. `params` may be arrays or shapes."""
  m = config.model
  matmul_weights = sum(int(np.prod(leaf.shape)) for path, leaf in
                       jax.tree_util.tree_leaves_with_path(params)
                       if getattr(path[-1], "key", None) == "kernel")
  head = m.vocab_size * m.n_embd
  attention = 12 * m.n_layer * m.context_length * m.n_embd
  return {"matmul_params": matmul_weights + head,
          "flops_per_token": 6 * (matmul_weights + head) + attention}


def attention_kernel(hlo_text: str) -> str:
  """"splash", "cudnn" or "xla": the fused attention kernel the program calls, if any."""
  return next((name for name, mark in _KERNEL_MARKS if mark.search(hlo_text)), "xla")


def attention_note(config, platform: str, kernel: str) -> str | None:
  """Why a program for an accelerator calls no fused attention kernel (`kernel` "xla"), with
  the setting that gives it one (attention_kernels.why_no_kernel); None where it calls one."""
  m = config.model
  if kernel != "xla":
    return None
  return attention_kernels.why_no_kernel(m.attention_impl, dtype=config.dtype,
                                         soft_capped=m.dot_norm_type == "tanh",
                                         seq_len=m.context_length, backend=platform)


def fast_path(model_config) -> str:
  """"applied" where the speed package built the program, else why it is the reference
  model: the unverified field and value (fast/plan.py), or the rules turned off."""
  if grad_rules.parse(grad_rules.mode_of(model_config))[0] == "off":
    return "off (model.grad_rules='off')"
  reason = fast_plan.unverified(model_config)
  return "applied" if reason is None else f"reference: {reason}"


def _shard_bytes(tree) -> int:
  """Bytes one device holds of `tree`'s (sharded ShapeDtypeStruct) leaves."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def memory_per_device(compiled) -> dict:
  """The train step's buffers on one device, bytes (see the module docstring)."""
  stats = compiled.train.memory_analysis()
  state = compiled.abstract_state
  params = _shard_bytes(state.params) + _shard_bytes(state.constants)
  optimizer_state = _shard_bytes(state.opt_state)
  batch = _shard_bytes(compiled.abstract_batch)
  arguments = int(stats.argument_size_in_bytes)
  memory = {"arguments": {"params": params, "optimizer_state": optimizer_state,
                          "batch": batch, "other": max(0, arguments - params
                                                       - optimizer_state - batch),
                          "total": arguments},
            "temporaries": int(stats.temp_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "donated_aliases": int(stats.alias_size_in_bytes),
            "code": int(stats.generated_code_size_in_bytes)}
  memory["total"] = (arguments + memory["temporaries"] + memory["outputs"]
                     - memory["donated_aliases"] + memory["code"])
  return memory


def summarize(compiled, config) -> dict[str, Any]:
  """The report of `compiled` (programs.CompiledSteps) for `config` as one JSON-able dict."""
  target, device = compiled.target, compiled.target.device
  hlo_text = compiled.train.as_text()
  program = hlo_costs.parse(hlo_text)
  sums = hlo_costs.totals(program)
  roofline_s = hlo_costs.roofline_seconds(program, device.peak_flops, device.hbm_bytes_per_s)
  memory = memory_per_device(compiled)
  tokens = config.batch_size * config.model.context_length
  useful_flops = (flops_per_token(config, compiled.abstract_state.params)["flops_per_token"]
                  * tokens / target.num_devices)
  cost = compiled.train.cost_analysis() or {}
  kernel = attention_kernel(hlo_text)
  return {
      "target": target.name,
      "device_kind": device.kind,
      "devices": target.num_devices,
      "hosts": targets.hosts_of(compiled.devices),
      "slices": target.num_slices,
      "mesh": dict(compiled.placement.mesh.shape),
      "fast_path": fast_path(config.model),
      "attention_kernel": kernel,
      "attention_note": attention_note(config, target.platform, kernel),
      "memory_per_device_bytes": memory,
      "eval_memory_per_device_bytes": _eval_total(compiled.eval),
      "device_memory_bytes": device.memory_bytes,
      "fits": memory["total"] <= device.memory_bytes,
      "flops_per_device": sums["flops"],
      "bytes_per_device": sums["bytes"],
      "non_matmul_bytes_per_device": sums["bytes"] - sums["matmul_bytes"],
      "collective_bytes_per_device": collectives.collective_bytes(program),
      "xla_cost_analysis": {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost},
      "roofline_step_s": roofline_s,
      "tokens_per_s_bound": tokens / roofline_s if roofline_s else None,
      "mfu_bound": useful_flops / roofline_s / device.peak_flops if roofline_s else None,
      "peak_flops_per_device": device.peak_flops,
      "hbm_bytes_per_s_per_device": device.hbm_bytes_per_s,
      "compile_s": compiled.compile_s,
      "versions": versions(),
      "date": datetime.date.today().isoformat(),
  }


def _eval_total(compiled_eval) -> int:
  stats = compiled_eval.memory_analysis()
  return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes
             + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.generated_code_size_in_bytes)


def versions() -> dict[str, str]:
  """The compiler stack the figures come from."""
  found = {}
  for name in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax"):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def text(summary: dict) -> str:
  """The report for people: a few lines."""
  gib = lambda n: f"{n / 2 ** 30:.2f} GiB"
  m = summary["memory_per_device_bytes"]
  args = m["arguments"]
  note = f" ({summary['attention_note']})" if summary.get("attention_note") else ""
  return "\n".join([
      f"{summary['target']}: {summary['devices']} x {summary['device_kind']} on "
      f"{summary['hosts']} host(s), mesh {summary['mesh']}, attention kernel "
      f"{summary['attention_kernel']}{note}; compiled in {summary['compile_s']:.1f} s.",
      f"Memory per device: {gib(m['total'])} of {gib(summary['device_memory_bytes'])} "
      f"({'fits' if summary['fits'] else 'DOES NOT FIT'}): params {gib(args['params'])}, "
      f"optimizer state {gib(args['optimizer_state'])}, batch {gib(args['batch'])}, "
      f"temporaries {gib(m['temporaries'])}, outputs {gib(m['outputs'])} "
      f"({gib(m['donated_aliases'])} donated), code {gib(m['code'])}.",
      f"Per device and step: {summary['flops_per_device'] / 1e12:.3f} TFLOP, "
      f"{summary['bytes_per_device'] / 1e9:.2f} GB moved "
      f"({summary['non_matmul_bytes_per_device'] / 1e9:.2f} GB outside matmuls); between "
      f"devices (not in the roofline): {_collectives_text(summary)}.",
      f"Roofline (an estimate from the program, not a timing): "
      f"{summary['roofline_step_s'] * 1e3:.2f} ms per step, <= "
      f"{summary['tokens_per_s_bound']:,.0f} tokens/s, MFU <= {summary['mfu_bound']:.1%}.",
  ])


def _collectives_text(summary: dict) -> str:
  found = summary["collective_bytes_per_device"]
  return ", ".join(f"{kind} {n / 1e9:.2f} GB" for kind, n in found.items()) or "nothing"

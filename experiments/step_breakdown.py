"""Where a training step's time goes: per part of the step, its time, FLOPs and bytes.

    python experiments/benchmark.py --configs=preln,sas_p --breakdown

Method, the same on every backend: the benchmark's compiled step runs `steps` times under
`jax.profiler`; every kernel the trace shows (an HLO instruction executed: a fusion, a matmul,
a copy, ...) is given to a part of the step by the name scopes XLA keeps in the instruction's
metadata (Flax module paths such as `h_3/attn/c_attn`, and the step's `loss` and `optimizer`
scopes), and its FLOPs and bytes come from the optimized HLO (hlo_costs.py). Parts:

  embedding        token and position lookups and their gradient scatter;
  attention core   everything inside `attn` but its linear layers: scores, masks, softmax,
                   the shaped terms and their gains, weighted values, head reshapes;
  block matmuls    the linear layers' matmuls (query/key, value, output projection, MLP);
  norms + other elementwise   norms, activations, residual sums, gains, dtype casts;
  head + loss      the tied head's matmuls and the cross-entropy (`loss` scope);
  optimizer        gradient scaling, clipping, AdamW (`optimizer` scope);
  other            anything else (random keys, copies between the parts), and the time of
                   the step's kernels that the trace ties to no HLO instruction.

A compiled program's breakdown (`roofline_breakdown`) also splits the bytes outside matmuls
(`non_matmul_parts`), with "norms + other elementwise" cut by what its kernels do (ELEMENTWISE):
  norms            the norms' kernels, forward and backward (`*norm*` and `ln_f` scopes);
  activation       the MLP's nonlinearity and its gradient;
  linear operands  what the linear layers' matmuls need besides the matmul: weight casts to
                   the compute dtype, input concatenations, split-K partial sums;
  residual + other the residual sums and anything else at the block's own scope;
and "other" loses what its instructions say they are: copies (copies and asynchronous copies
and slices between memories: a TPU's prefetches into VMEM and evictions) and collectives.
It also sets each norm's bytes against a one-pass floor (`norm_floors`): what the norm reads
from outside read once and its result written once, the traffic of a kernel that keeps a row
on chip; what XLA moves beyond it is what such a kernel could save.

time is the kernels' summed device time per step. On a GPU or TPU that is the device's op
timeline, so the parts add up to the step less its idle gaps. On a CPU it is the duration of
each kernel (XLA's thunks), which XLA may run concurrently on several threads: the parts can
add up to more than the step's wall time (both are printed), and their shares are what to
read. A kernel that XLA fused across two parts is counted whole in the part of its matmul, or
else of the op its metadata names.
"""
import collections
import glob
import os
import re
import tempfile
from typing import Any, Dict

import jax

from simplified_flax.aot import device_bytes
from simplified_flax.aot import hlo_costs

PARTS = ("embedding", "attention core", "block matmuls", "norms + other elementwise",
         "head + loss", "optimizer", "other")
ATTENTION_LINEARS = ("c_attn", "value", "proj")   # attention's own linear layers (block.py)
UNATTRIBUTED = "(kernels of the step tied to no instruction)"
ELEMENTWISE = ("norms", "activation", "linear operands", "residual + other")
NON_MATMUL_PARTS = ("embedding", "attention core", *ELEMENTWISE, "head + loss", "optimizer",
                    "copies", "collectives", "other")
COPIES = ("copy", "copy-start", "slice-start")
NORM_SCOPE = re.compile(r"/(ln_f|[^/]*norm[^/]*)/")   # a norm's scope in an op_name
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def part_of(op_name: str, is_matmul: bool) -> str:
  """The part of the step an instruction with this metadata op_name belongs to."""
  if "optimizer" in op_name:
    return "optimizer"
  if re.search(r"\bloss\b", op_name) or "btd,vd->btv" in op_name:
    return "head + loss"
  if re.search(r"/(wte|wpe)/", op_name):
    return "embedding"
  sub = re.search(r"/attn/([^/]+)", op_name)
  if sub and sub.group(1) in ATTENTION_LINEARS:
    return "block matmuls" if is_matmul else "norms + other elementwise"
  if sub and not sub.group(1).endswith("norm"):
    return "attention core"
  if is_matmul and re.search(r"/(mlp|h_\d+)/", op_name):
    return "block matmuls"
  if "Transformer" in op_name:
    return "norms + other elementwise"
  return "other"


def elementwise_kind(op_name: str) -> str:
  """Which of ELEMENTWISE a kernel of "norms + other elementwise" belongs to, by its scope."""
  if NORM_SCOPE.search(op_name):
    return "norms"
  if re.search(r"/(c_attn|value|proj|c_fc|c_proj|linear)/", op_name):
    return "linear operands"
  if "/mlp/" in op_name:
    return "activation"
  return "residual + other"


def non_matmul_part(op_name: str, opcode: str = "") -> str:
  """The part of NON_MATMUL_PARTS a kernel that is not a matmul belongs to: by its scope, else
  (no scope of a part) by its instruction."""
  part = part_of(op_name, False)
  if part == "norms + other elementwise":
    return elementwise_kind(op_name)
  if part == "other" and opcode in COPIES:
    return "copies"
  if part == "other" and opcode.removesuffix("-start") in COLLECTIVES:
    return "collectives"
  return part


def non_matmul_bytes_by_part(program: hlo_costs.Program) -> Dict[str, float]:
  """The bytes per step of `program`'s kernels that are not matmuls, by NON_MATMUL_PARTS
  (they add up to hlo_costs.totals' bytes less its matmul bytes)."""
  found = dict.fromkeys(NON_MATMUL_PARTS, 0.0)
  for kernel in program.kernels.values():
    if not kernel.is_matmul:
      found[non_matmul_part(kernel.op_name, kernel.opcode)] += kernel.bytes * kernel.runs
  return found


def norm_floors(program: hlo_costs.Program) -> Dict[str, Dict[str, float]]:
  """Each norm's bytes per step against a one-pass floor, by norm and direction, summed over
  the layers: {"norm1 forward": {"bytes": B, "floor": F}, "norm1 backward": ..., "ln_f
  forward": ...}. The floor of one norm one way (a layer's norm1 backward, say: the "norms"
  kernels of its scope, the backward's under `transpose(`) is every tensor its kernels read
  from outside it, read once, and the largest array they write, written once (the normed
  output; dx): what a kernel that keeps a row on chip would move. XLA moves more where it
  reads x again after a row's statistics, or writes a sum of gradients for a second kernel.
  F is never above B (a scanned loop's stacked inputs count whole, so they are capped)."""
  def source(name: str) -> str:   # through the tuple elements and bitcasts of one result
    inst = program.instructions.get(name)
    while inst is not None and inst.opcode in ("get-tuple-element", "bitcast") and inst.operands:
      name = inst.operands[0]
      inst = program.instructions.get(name)
    return name

  instances: Dict[tuple, list] = collections.defaultdict(list)
  for name, kernel in program.kernels.items():
    if kernel.is_matmul or non_matmul_part(kernel.op_name, kernel.opcode) != "norms":
      continue
    found = NORM_SCOPE.search(kernel.op_name)
    layer = re.findall(r"/(h_\d+)/", kernel.op_name[:found.start() + 1])
    direction = "backward" if "transpose(" in kernel.op_name else "forward"
    instances[(layer[-1] if layer else "", found.group(1), direction)].append(kernel)
  floors: Dict[str, Dict[str, float]] = {}
  order = lambda key: (key[1] == "ln_f", key[1], key[2] == "backward", key[0])
  for (_, norm, direction), kernels in sorted(instances.items(), key=lambda kv: order(kv[0])):
    members = {k.name for k in kernels}
    reads = {(source(o), program.instructions[o].shape): device_bytes.device_bytes(
                 program.instructions[o].shape)
             for k in kernels for o in k.operands
             if o in program.instructions and source(o) not in members}
    written = max(device_bytes.device_bytes(a) for k in kernels
                  for a in device_bytes.arrays(hlo_costs.result_shape(k)))
    moved = sum(k.bytes * k.runs for k in kernels)
    runs = max(k.runs for k in kernels)
    row = floors.setdefault(f"{norm} {direction}", {"bytes": 0.0, "floor": 0.0})
    row["bytes"] += moved
    row["floor"] += min(moved, runs * (sum(reads.values()) + written))
  return floors


def kernel_seconds(run, steps: int, program: hlo_costs.Program) -> Dict[str, float]:
  """Device seconds per step of each kernel (HLO instruction name) of `program` while
  `run(steps)` runs under the profiler; {} when the trace has none (no device tracer)."""
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    try:
      run(steps)
    finally:
      jax.profiler.stop_trace()
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return {}
    planes = list(jax.profiler.ProfileData.from_file(files[0]).planes)
  devices = [p for p in planes if p.name.startswith("/device:")]
  for plane in sorted(devices, key=lambda p: p.name) + [p for p in planes if p not in devices]:
    seconds = _plane_kernel_seconds(plane, program)
    if seconds:
      return {name: s / steps for name, s in seconds.items()}
  return {}


def _plane_kernel_seconds(plane, program: hlo_costs.Program) -> Dict[str, float]:
  """Kernel events carry their instruction in an "hlo_op" stat (CPU, GPU), or are named after
  it on an "XLA Ops" line (TPU); a GPU kernel without the stat is matched by its name, which
  XLA derives from the instruction's ("loop_add_fusion.3" -> "loop_add_fusion_3")."""
  by_kernel_name = {re.sub(r"\W", "_", name): name for name in program.kernels}
  lines = list(plane.lines)
  ops_lines = [line for line in lines if line.name == "XLA Ops"]
  seconds: Dict[str, float] = collections.defaultdict(float)
  containers: Dict[str, float] = collections.defaultdict(float)
  for line in ops_lines or lines:
    for event in line.events:
      stats = dict(event.stats)
      if str(stats.get("hlo_module", program.module)) != program.module:
        continue
      if int(stats.get("device_ordinal", 0) or 0) != 0:
        continue
      name = str(stats.get("hlo_op") or event.name)
      if name in program.instructions and name not in program.kernels:
        containers[name] += event.duration_ns * 1e-9   # a loop, call or command buffer
        continue
      name = name if name in program.kernels else by_kernel_name.get(re.sub(r"\W", "_", name))
      if name or "hlo_module" in stats or ops_lines:
        seconds[name or UNATTRIBUTED] += event.duration_ns * 1e-9
  # A container's time counts only when none of its kernels was seen on its own (e.g. kernels
  # replayed from a CUDA graph that the trace shows as the graph's launch alone).
  seen = {program.kernels[name].computation for name in seconds if name in program.kernels}
  for name, container_s in containers.items():
    if not program.computations_under(name) & seen:
      seconds[UNATTRIBUTED] += container_s
  return dict(seconds)


def breakdown(compiled, run, steps: int = 3) -> Dict[str, Any]:
  """{"parts": {part: {"time_s", "share", "flops", "bytes"}}, "op_time_s", "timed"}: per step
  of the compiled program `compiled`, whose `run(steps)` executes it `steps` times."""
  program = hlo_costs.parse(compiled.as_text())
  times = kernel_seconds(run, steps, program)
  parts = {p: {"time_s": 0.0, "flops": 0.0, "bytes": 0.0} for p in PARTS}
  for name, kernel in program.kernels.items():
    part = parts[part_of(kernel.op_name, kernel.is_matmul)]
    part["flops"] += kernel.flops * kernel.runs
    part["bytes"] += kernel.bytes * kernel.runs
    part["time_s"] += times.get(name, 0.0)
  parts["other"]["time_s"] += times.get(UNATTRIBUTED, 0.0)
  total = sum(p["time_s"] for p in parts.values())
  for p in parts.values():
    p["share"] = p["time_s"] / total if total else None
  return {"parts": parts, "op_time_s": total, "timed": bool(times),
          "method": "jax.profiler kernel times; FLOPs and bytes from the optimized HLO"}


def roofline_breakdown(program: hlo_costs.Program, peak_flops: float,
                       hbm_bytes_per_s: float) -> Dict[str, Any]:
  """`breakdown`'s dict for a program compiled for a device this host lacks (python
  experiments/benchmark.py --target=h200 --breakdown): each part's time is its kernels'
  roofline (hlo_costs.roofline_seconds' rule: an estimate read from the program, not a
  timing), with their FLOPs and bytes; "non_matmul_bytes" too, and "non_matmul_parts"
  (`non_matmul_bytes_by_part`)."""
  parts = {p: {"time_s": 0.0, "flops": 0.0, "bytes": 0.0, "non_matmul_bytes": 0.0}
           for p in PARTS}
  for kernel in program.kernels.values():
    part = parts[part_of(kernel.op_name, kernel.is_matmul)]
    part["flops"] += kernel.flops * kernel.runs
    part["bytes"] += kernel.bytes * kernel.runs
    part["non_matmul_bytes"] += 0.0 if kernel.is_matmul else kernel.bytes * kernel.runs
    part["time_s"] += hlo_costs.kernel_seconds(kernel, peak_flops, hbm_bytes_per_s) * kernel.runs
  total = sum(p["time_s"] for p in parts.values())
  for p in parts.values():
    p["share"] = p["time_s"] / total if total else None
  return {"parts": parts, "op_time_s": total, "timed": True,
          "non_matmul_parts": non_matmul_bytes_by_part(program),
          "norm_floors": norm_floors(program),
          "method": "roofline per kernel (max of FLOPs / peak and bytes / HBM bandwidth) from "
                    "the optimized HLO of the program compiled for the target"}


def table(name: str, result: Dict[str, Any], step_time_s: float) -> str:
  """The breakdown as text: one row per part, then the total."""
  rows = [("part", "time/step", "share", "GFLOP", "GB", "FLOP/byte")]
  for part, p in result["parts"].items():
    rows.append((part, f"{1e3 * p['time_s']:.2f}ms" if result["timed"] else "-",
                 f"{100 * p['share']:.1f}%" if p["share"] is not None else "-",
                 f"{p['flops'] / 1e9:.3f}", f"{p['bytes'] / 1e9:.3f}",
                 f"{p['flops'] / p['bytes']:.1f}" if p["bytes"] else "-"))
  flops = sum(p["flops"] for p in result["parts"].values())
  data = sum(p["bytes"] for p in result["parts"].values())
  rows.append(("all kernels", f"{1e3 * result['op_time_s']:.2f}ms", "100%", f"{flops / 1e9:.3f}",
               f"{data / 1e9:.3f}", f"{flops / data:.1f}" if data else "-"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  text = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                             enumerate(zip(r, widths))) for r in rows)
  if result.get("non_matmul_parts"):
    text += "\nGB outside matmuls: " + ", ".join(
        f"{part} {found / 1e9:.3f}" for part, found in result["non_matmul_parts"].items() if found)
  if result.get("norm_floors"):
    floors = result["norm_floors"]
    over = sum(f["bytes"] - f["floor"] for f in floors.values())
    text += ("\nGB of the norms (one-pass floor): " + ", ".join(
        f"{norm} {f['bytes'] / 1e9:.3f} ({f['floor'] / 1e9:.3f})" for norm, f in floors.items())
             + f"; over the floor {over / 1e9:.3f}")
  if result["method"].startswith("roofline"):
    return (f"breakdown of {name}: roofline {1e3 * result['op_time_s']:.2f}ms per step (an "
            f"estimate read from the compiled program, not a timing)\n{text}")
  note = "" if result["timed"] else " (the trace had no kernel times: FLOPs and bytes only)"
  return (f"breakdown of {name}: step {1e3 * step_time_s:.1f}ms wall, kernels "
          f"{1e3 * result['op_time_s']:.1f}ms summed{note}\n{text}")


def add_breakdowns(runners, results: Dict[str, Dict[str, Any]], steps: int = 3) -> None:
  """Profiles `steps` steps of each benchmark.Runner, prints its breakdown table and stores
  it as results[name]["breakdown"]."""
  for runner in runners:
    result = breakdown(runner.step, runner.run, steps)
    results[runner.name]["breakdown"] = result
    print(table(runner.name, result, results[runner.name]["step_time_s"]) + "\n", flush=True)

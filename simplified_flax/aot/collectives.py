"""What a compiled program sends between devices: each collective's bytes per device and step,
read from its optimized HLO. The roofline (hlo_costs.py) counts HBM traffic and FLOPs, not the
links between chips; these figures are what it leaves out.

    collective_bytes(hlo_costs.parse(compiled.as_text()))   # {"all-reduce": 4.1e8, ...}

A collective counts the whole array it reduces or gathers, as one device holds it whole:
an all-reduce's, all-gather's, all-to-all's or collective-permute's result, a reduce-scatter's
operand; a combined collective every array it carries; unpadded (dtype bytes x elements);
times its runs. An asynchronous one counts at its start (`all-gather-start` and
`collective-permute-start` return (operands, results, ...): the results), its done nothing.
XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and the device's slices of its
results (a fused computation named `all-reduce-scatter...`): a reduce-scatter of those arrays.
A collective inside any other fusion counts as its own kind.
What each device sends over its links follows from the algorithm: a ring all-reduce of S bytes
over n devices sends 2 (n - 1) / n S, an all-gather or reduce-scatter (n - 1) / n S.
"""
import math
from typing import Dict, List

from simplified_flax.aot import device_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_RESULTS_SECOND = ("all-gather-start", "collective-permute-start")   # (operands, results, ...)


def collective_bytes(program) -> Dict[str, float]:
  """{kind: bytes per device and step} for each collective kind in `program`
  (hlo_costs.Program), in KINDS order; kinds absent from the program are left out."""
  found = {}
  for kernel in program.kernels.values():
    ops, fused = [kernel], ()
    if kernel.opcode == "fusion":
      fused = program.computations_under(kernel.name)
      ops = [i for i in program.instructions.values() if i.computation in fused]
    scatter = any(name.startswith("all-reduce-scatter") for name in fused)
    for op in ops:
      kind = op.opcode[:-len("-start")] if op.opcode.endswith("-start") else op.opcode
      if kind not in KINDS:
        continue
      if kind == "reduce-scatter":
        shape = " ".join(program.instructions[name].shape for name in op.operands)
      elif op.opcode in _RESULTS_SECOND:
        shape = top_level_elements(op.shape)[1]
      else:
        shape = op.shape
      kind = "reduce-scatter" if scatter and kind == "all-reduce" else kind
      found[kind] = found.get(kind, 0.0) + logical_bytes(shape) * kernel.runs
  return {kind: found[kind] for kind in KINDS if kind in found}


def logical_bytes(shape: str) -> float:
  """Bytes of every array in a shape text, unpadded: dtype bytes x elements."""
  return sum(device_bytes.DTYPE_BYTES.get(found.group(1), 4)
             * math.prod(int(d) for d in found.group(2).split(",") if d)
             for found in device_bytes.ARRAY.finditer(shape))


def top_level_elements(shape: str) -> List[str]:
  """The elements of a tuple shape text, e.g. "(f32[2], (s32[], f32[4]))" ->
  ["f32[2]", "(s32[], f32[4])"]; a shape that is not a tuple is its one element."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(shape):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    if (char == "," and depth == 1) or (char == ")" and depth == 0):
      elements.append(shape[start:i].strip())
      start = i + 1
  return [e for e in elements if e]

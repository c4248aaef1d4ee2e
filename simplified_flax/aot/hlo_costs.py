"""FLOPs and bytes of each kernel of a compiled XLA program, read from its optimized HLO text.

    roofline_seconds(program, peak_flops, hbm_bytes_per_s)   # the step's lower bound

The rules are the same for NVIDIA and TPU programs (a TPU's matmuls are convolutions inside
its fusions). The roofline sums, over kernels and their runs, max(FLOPs / peak FLOP/s, bytes /
HBM bandwidth): each kernel at the better of its two ceilings, kernels one after another.

    program = parse(compiled.as_text())
    for name, op in program.kernels.items():   # every instruction that runs as a kernel
      op.flops, op.bytes, op.runs, op.op_name, op.is_matmul

Counting rules (XLA's own cost-analysis conventions, applied per instruction):
  * flops: 2 * (result elements) * (contracted elements) per matmul (`dot`, `convolution`,
    GEMM custom calls, and dots inside fusions); one per result element of any other
    arithmetic instruction (a reduce: one per input element); data movement and library
    calls other than GEMMs (e.g. cuDNN attention) count none.
  * bytes (kernel_bytes.py): the kernel's operands plus its result, i.e. what it reads and
    writes in the device's main memory (HBM; a fusion's intermediates stay in registers and
    are not counted), each array as device_bytes.py stores it: arrays a TPU program keeps
    in on-chip memory (`S(1)`, VMEM) count none, and TPU tiles are padded (d = 64 in 128
    lanes).
  * An asynchronous copy (`copy-start` ... `copy-done`, a TPU's prefetch into VMEM or
    eviction from it) moves its buffer once: its source and destination, each where it lies
    in HBM, at the start; the done counts none. An asynchronous slice (`slice-start`, a TPU's
    prefetch of a weight's rows) reads and writes the slice, each side where it lies in HBM.
  * A GEMM custom call (e.g. `__cublas$lt$matmul`) returns a tuple (result, s8[...] workspace):
    only the first element is its result, for FLOPs and bytes alike; the workspace is scratch
    the library may leave untouched, and counting it as result elements would inflate a
    weight-gradient GEMM's FLOPs several times over.
  * A Pallas GEMM (a custom call under a name scope starting `pallas_gemm`, e.g.
    `fast.relu_matmul_kernel`'s) is a matmul: its first operand is the [M, K] input and its
    result [M, N], so 2 * M * N * K FLOPs. A Triton call carries no cost of its own; any
    other Pallas kernel counts none.
  * An in-place update (a `dynamic-update-slice` or a `scatter`, or a fusion whose root is
    one, e.g. a scan writing one step's slice of its stacked output, or an embedding's
    gradient scatter-added into its table) writes into its operand's buffer: it reads and
    writes the slice or the rows it updates, not the whole buffer, so that buffer's bytes
    count neither as read nor as written (XLA's own cost analysis counts it so; XLA updates
    such a buffer in place, and copies it first, as a kernel of its own, where it cannot).
  * A slice read (a `dynamic-slice`, `slice` or `gather`, or a fusion whose parameter feeds
    only such reads, e.g. a scan's backward reading one step of its stacked residuals, or an
    embedding lookup's rows of its table) reads the slices, not the whole buffer: the buffer
    counts as those slices' bytes (at most its own).
  * runs: executions per call of the program: 1 in the entry computation, times the trip
    count of each enclosing `while` loop: XLA's `known_trip_count` (XLA:GPU records it),
    else the bound N of a condition `counter < N` (jax's scans and fori_loops count from 0
    by 1; XLA:TPU records no trip count), else 1.
"""
import dataclasses
import math
import re
from typing import Dict, List, Optional

from simplified_flax.aot import device_bytes
from simplified_flax.aot import kernel_bytes

# Instructions that never run as a kernel of their own, or only organise others.
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "conditional", "call", "after-all", "partition-id", "replica-id"}
NO_FLOPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "broadcast",
            "reshape", "transpose", "copy", "slice", "dynamic-slice", "dynamic-update-slice",
            "concatenate", "pad", "iota", "gather", "scatter", "reverse", "convert",
            "bitcast-convert", "copy-start", "copy-done", "all-gather", "all-reduce",
            "collective-permute", "all-to-all", "reduce-scatter", "custom-call", "fusion",
            "while", "call", "conditional", "sort", "rng-bit-generator", "optimization-barrier"}
GEMM_TARGETS = ("gemm", "matmul", "cublas")
PALLAS_GEMM_SCOPE = "/pallas_gemm"   # the name scope of the project's Pallas GEMM kernels
_SHAPE = device_bytes.ARRAY   # one array of a shape text: dtype, dims, layout
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: str                      # the result's shape text, e.g. "bf16[8,128,768]{2,1,0}"
  operands: List[str]
  attrs: str
  computation: str
  op_name: str = ""               # jax's name-scope path (metadata op_name)
  parameter_number: int = -1      # a parameter's index, e.g. 1 for `parameter(1)`
  literal: str = ""               # a constant's value as written, e.g. "7" for `constant(7)`
  flops: float = 0.0
  bytes: float = 0.0
  runs: int = 1
  is_matmul: bool = False


@dataclasses.dataclass
class Program:
  module: str                                  # the HloModule's name
  instructions: Dict[str, Instruction]         # every instruction, by its unique name
  kernels: Dict[str, Instruction]              # those that run as kernels, costs filled in
  calls: Dict[str, List[str]]                  # computations each instruction calls

  def computations_under(self, name: str) -> set:
    """Every computation a loop, call or fusion `name` runs, however deeply nested."""
    found, stack = set(), list(self.calls.get(name, ()))
    while stack:
      computation = stack.pop()
      if computation not in found:
        found.add(computation)
        stack += [c for i in self.instructions.values() if i.computation == computation
                  for c in self.calls.get(i.name, ())]
    return found


def shape_elements(shape: str) -> int:
  return sum(math.prod(int(d) for d in found.group(2).split(",") if d)
             for found in _SHAPE.finditer(shape))


def _dims(shape: str) -> List[int]:
  found = _SHAPE.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _parse_instruction(line: str, computation: str) -> Optional[Instruction]:
  found = _INSTRUCTION.match(line)
  if not found:
    return None
  name, rest = found.groups()
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  opcode = re.match(r"[\w\-]+", rest)
  if not opcode:
    return None
  close = _balanced(rest, opcode.end())
  operands = re.findall(r"%([^\s,()]+)", rest[opcode.end():close])
  attrs = rest[close:]
  op_name = re.search(r'op_name="([^"]*)"', attrs)
  number = opcode.group(0) == "parameter" and re.match(r"\((\d+)\)", rest[opcode.end():])
  literal = rest[opcode.end() + 1:close - 1] if opcode.group(0) == "constant" else ""
  return Instruction(name, opcode.group(0), shape, operands, attrs, computation,
                     op_name.group(1) if op_name else "", int(number.group(1)) if number else -1,
                     literal)


def _contracted(inst: Instruction, shapes: Dict[str, str]) -> int:
  """Product of the lhs's contracted dimensions of a dot or GEMM custom call; for a
  convolution (TPU programs write their matmuls as convolutions) the kernel's input-feature
  size times its window (`dim_labels=0bf_io0->0bf`: the rhs's `i`)."""
  if inst.opcode == "convolution":
    return _convolution_contracted(inst, shapes)
  found = (re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.attrs) or
           re.search(r'"lhs_contracting_dimensions":\[([0-9",]*)\]', inst.attrs))
  lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else []
  if not found or not lhs:
    return 0
  return math.prod(lhs[int(d)] for d in found.group(1).replace('"', "").split(",") if d)


def _convolution_contracted(inst: Instruction, shapes: Dict[str, str]) -> int:
  labels = re.search(r"dim_labels=[^_]*_([^-]*)->", inst.attrs)
  rhs = _dims(shapes.get(inst.operands[1], "")) if len(inst.operands) > 1 else []
  if not labels or len(labels.group(1)) != len(rhs) or "i" not in labels.group(1):
    return 0
  window = re.search(r"window=\{size=([0-9x]+)", inst.attrs)
  sizes = [int(w) for w in window.group(1).split("x")] if window else []
  # A TPU writes a batched matmul's batch dimensions as a window with lhs_dilate equal to its
  # size: one of its taps lands on an input element per output, the rest on dilation holes.
  dilate = re.search(r"window=\{[^}]*lhs_dilate=([0-9x]+)", inst.attrs)
  dilations = [int(d) for d in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
  taps = math.prod(-(-size // d) for size, d in zip(sizes, dilations))
  return rhs[labels.group(1).index("i")] * taps


def _is_gemm(inst: Instruction) -> bool:
  target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
  return inst.opcode == "custom-call" and bool(target) and any(
      key in target.group(1).lower() for key in GEMM_TARGETS)


def _is_pallas_gemm(inst: Instruction) -> bool:
  return inst.opcode == "custom-call" and PALLAS_GEMM_SCOPE in inst.op_name


def result_shape(inst: Instruction) -> str:
  """The shape of what `inst` produces: a GEMM custom call's first tuple element (its
  workspace left out), else the whole shape."""
  if _is_gemm(inst) and inst.shape.startswith("("):
    found = _SHAPE.search(inst.shape)
    return found.group(0) if found else inst.shape
  return inst.shape


def _flops(inst: Instruction, shapes, computations, called) -> float:
  if inst.opcode in ("dot", "convolution") or _is_gemm(inst):
    return 2.0 * shape_elements(result_shape(inst)) * _contracted(inst, shapes)
  if _is_pallas_gemm(inst):
    lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else []
    return 2.0 * shape_elements(inst.shape) * (lhs[-1] if lhs else 0)
  if inst.opcode == "fusion":
    return sum(_flops(i, shapes, computations, called) for c in called.get(inst.name, ())
               for i in computations.get(c, ()))
  if inst.opcode == "reduce":
    return float(shape_elements(shapes.get(inst.operands[0], ""))) if inst.operands else 0.0
  return 0.0 if inst.opcode in NO_FLOPS else float(shape_elements(inst.shape))


def _has_matmul(inst: Instruction, computations, called) -> bool:
  if inst.opcode in ("dot", "convolution") or _is_gemm(inst) or _is_pallas_gemm(inst):
    return True
  return inst.opcode == "fusion" and any(
      _has_matmul(i, computations, called) for c in called.get(inst.name, ())
      for i in computations.get(c, ()))


def parse(hlo_text: str) -> Program:
  """The kernels of an optimized HLO module with their FLOPs, bytes and runs per call."""
  module = re.search(r"HloModule\s+([^\s,]+)", hlo_text)
  computations: Dict[str, List[Instruction]] = {}
  roots: Dict[str, str] = {}                   # computation -> its ROOT instruction's name
  entry, current = "", ""
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line)
    if header and not line.startswith(" "):
      current = header.group(2)
      entry = current if header.group(1) else entry
      computations[current] = []
      continue
    inst = _parse_instruction(line, current) if current else None
    if inst:
      computations[current].append(inst)
      if line.lstrip().startswith("ROOT "):
        roots[current] = inst.name
  instructions = {i.name: i for insts in computations.values() for i in insts}
  shapes = {name: i.shape for name, i in instructions.items()}
  called = {i.name: re.findall(r"(?:calls|body|condition|to_apply|branch_computations)="
                               r"\{?%([^\s,}]+)", i.attrs) for i in instructions.values()}
  runs = _runs_per_computation(entry, computations, called)
  users: Dict[str, List[Instruction]] = {}
  for i in instructions.values():
    for o in i.operands:
      users.setdefault(o, []).append(i)
  kernels = {}
  for name, inst in instructions.items():
    if inst.computation not in runs or inst.opcode in NOT_KERNELS:
      continue   # fused computations' members run inside their fusion's kernel
    inst.runs = runs[inst.computation]
    inst.flops = _flops(inst, shapes, computations, called)
    inst.bytes = kernel_bytes.kernel_bytes(inst, result_shape(inst), instructions, computations,
                                           roots, called, users)
    inst.is_matmul = _has_matmul(inst, computations, called)
    kernels[name] = inst
  return Program(module.group(1) if module else "", instructions, kernels, called)


def _runs_per_computation(entry, computations, called) -> Dict[str, int]:
  """Runs per program call of each computation that schedules kernels (entry, loop bodies and
  conditions, called and branch computations); fused computations are left out."""
  runs, stack = {entry: 1}, [entry]
  while stack:
    parent = stack.pop()
    for inst in computations.get(parent, ()):
      if inst.opcode not in ("while", "call", "conditional"):
        continue
      trips = _trip_count(inst, computations) if inst.opcode == "while" else 1
      for child in called.get(inst.name, ()):
        runs[child] = runs[parent] * trips
        stack.append(child)
  return runs


def _trip_count(loop: Instruction, computations) -> int:
  """A `while` loop's trips: XLA's `known_trip_count` where the program records it (XLA:GPU
  does); else the bound N of a condition `counter < N` (a scan's counter, from 0 by 1: how
  jax lowers `lax.scan` and `fori_loop`, and what XLA:TPU leaves unannotated); else 1."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%([^\s,}]+)", loop.attrs)
  insts = {i.name: i for i in computations.get(condition.group(1) if condition else "", ())}
  compare = [i for i in insts.values() if i.opcode == "compare" and "direction=LT" in i.attrs]
  if len(compare) != 1 or len(compare[0].operands) != 2:
    return 1
  bound = insts.get(compare[0].operands[1])
  if bound is None or bound.opcode != "constant" or not bound.literal.isdigit():
    return 1
  return int(bound.literal)


def totals(program: Program) -> Dict[str, float]:
  """The program's FLOPs and bytes per call, all kernels and the matmul kernels alone."""
  sums = {"flops": 0.0, "bytes": 0.0, "matmul_flops": 0.0, "matmul_bytes": 0.0}
  for op in program.kernels.values():
    sums["flops"] += op.flops * op.runs
    sums["bytes"] += op.bytes * op.runs
    if op.is_matmul:
      sums["matmul_flops"] += op.flops * op.runs
      sums["matmul_bytes"] += op.bytes * op.runs
  return sums


def kernel_seconds(op: Instruction, peak_flops: float, hbm_bytes_per_s: float) -> float:
  """One run of `op` at the better of its two ceilings."""
  return max(op.flops / peak_flops, op.bytes / hbm_bytes_per_s)


def roofline_seconds(program: Program, peak_flops: float, hbm_bytes_per_s: float) -> float:
  """The step's roofline: every kernel's `kernel_seconds`, times its runs, added up."""
  return sum(kernel_seconds(op, peak_flops, hbm_bytes_per_s) * op.runs
             for op in program.kernels.values())

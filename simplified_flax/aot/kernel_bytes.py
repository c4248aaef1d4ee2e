"""What one kernel of a parsed HLO program (hlo_costs.parse) reads and writes in HBM: its
operands and result as device_bytes.py stores them, by the rules of hlo_costs.py's docstring
(in-place updates, slice and gather reads, asynchronous copies and slices)."""
from typing import Any, List

from simplified_flax.aot import device_bytes

shape_bytes = device_bytes.device_bytes   # a shape's bytes in HBM


def _shape_of(instructions, name: str) -> str:
  """The shape text of instruction `name`, "" where the program has none of that name."""
  return instructions[name].shape if name in instructions else ""


ASYNC_DONE = ("copy-done", "slice-done")   # completions: their start moved the bytes


def _async_start_bytes(inst, operand_shape: str) -> float | None:
  """The bytes an asynchronous copy or slice moves, counted at its start: the source read
  and the destination written, each where it lies in HBM; None for other instructions.
  A `copy-start`'s result tuple is (destination, source alias, context): a prefetch into VMEM
  reads HBM once, an eviction from VMEM writes it once. A `slice-start`'s is ((source alias),
  destination slice, context), and it reads the slice's rows of its source."""
  if inst.opcode not in ("copy-start", "slice-start"):
    return None
  source = device_bytes.arrays(operand_shape)
  result = device_bytes.arrays(inst.shape)
  if not source or len(result) < 3:
    return None
  moved = result[0] if inst.opcode == "copy-start" else result[-2]   # the destination
  read_from_hbm = device_bytes.memory_space(source[0]) == 0
  return (device_bytes.stored_bytes(moved) * read_from_hbm
          + device_bytes.device_bytes(moved))


def kernel_bytes(inst, result_shape: str, instructions, computations, roots, called,
                 users) -> float:
  """What kernel `inst` (its result `result_shape`, e.g. a GEMM's without its workspace)
  reads and writes in HBM: its operands and result, less the buffers it only updates or reads
  in slices; an asynchronous start its transfer, a done none."""
  if inst.opcode in ASYNC_DONE:
    return 0.0
  operand_shapes = [_shape_of(instructions, o) for o in inst.operands]
  moved = _async_start_bytes(inst, operand_shapes[0] if operand_shapes else "")
  if moved is not None:
    return moved
  total = shape_bytes(result_shape) + sum(shape_bytes(shape) for shape in operand_shapes)
  total -= _bytes_updated_in_place(inst, instructions, roots, called)
  return total - _bytes_not_sliced(inst, instructions, computations, called, users)


def _in_place_pairs(inst) -> List[tuple]:
  """(buffer operand, update operand) names of an in-place update: a `dynamic-update-slice`
  (buffer, update, offsets...), or a `scatter` (buffers..., indices, updates...), which
  writes its updates' rows into its buffers; [] for other instructions."""
  if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
    return [(inst.operands[0], inst.operands[1])]
  if inst.opcode == "scatter" and len(inst.operands) >= 3 and len(inst.operands) % 2 == 1:
    n = len(inst.operands) // 2
    return list(zip(inst.operands[:n], inst.operands[n + 1:]))
  return []


def _bytes_updated_in_place(inst, instructions, roots, called) -> float:
  """Of `inst`'s operand and result bytes, those of the buffers it updates in place and does
  not touch beyond the update: the whole buffer (as an operand and as the result) less the
  update (read and written)."""
  shape = lambda name: _shape_of(instructions, name)
  pairs = _in_place_pairs(inst)
  if pairs:
    return sum(2 * max(0.0, shape_bytes(shape(buffer)) - shape_bytes(shape(update)))
               for buffer, update in pairs)
  if inst.opcode != "fusion" or not called.get(inst.name):
    return 0.0
  root = instructions.get(roots.get(called[inst.name][0], ""))
  outputs = ([instructions.get(o) for o in root.operands] if root and root.opcode == "tuple"
             else [root])
  saved = 0.0
  for out in outputs:
    for buffer_name, update_name in (_in_place_pairs(out) if out is not None else ()):
      buffer = instructions.get(buffer_name)
      while buffer is not None and buffer.opcode == "bitcast" and buffer.operands:
        buffer = instructions.get(buffer.operands[0])   # a bitcast is the same buffer
      if buffer is None or buffer.opcode != "parameter" or buffer.parameter_number < 0:
        continue   # a buffer made inside the fusion is written whole
      saved += 2 * max(0.0, shape_bytes(buffer.shape) - shape_bytes(shape(update_name)))
  return saved


SLICES = ("dynamic-slice", "slice", "gather")   # reads of part of their first operand


def _bytes_not_sliced(inst, instructions, computations, called, users) -> float:
  """Of `inst`'s operand bytes, those of the buffers it reads only slices of: each such buffer
  less the slices taken from it."""
  if inst.opcode in SLICES and inst.operands and inst.operands[0] in instructions:
    return max(0.0, shape_bytes(instructions[inst.operands[0]].shape) - shape_bytes(inst.shape))
  if inst.opcode != "fusion" or not called.get(inst.name):
    return 0.0
  saved = 0.0
  for param in computations.get(called[inst.name][0], ()):
    if param.opcode != "parameter" or param.parameter_number >= len(inst.operands):
      continue
    readers = _readers_through_bitcasts(param.name, users)
    if readers and all(r is not None and r.opcode in SLICES for r in readers):
      saved += max(0.0, shape_bytes(param.shape) - sum(shape_bytes(r.shape) for r in readers))
  return saved


def _readers_through_bitcasts(name: str, users) -> List[Any]:
  """The instructions that read `name`'s buffer, looking through bitcasts (the same buffer),
  each one reading it as its first operand; [None] if one reads it otherwise."""
  readers = []
  for user in users.get(name, []):
    if user.opcode == "bitcast":
      readers += _readers_through_bitcasts(user.name, users)
    else:
      readers.append(user if user.operands and user.operands[0] == name else None)
  return readers

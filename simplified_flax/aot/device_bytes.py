"""Bytes that an array of an optimized HLO program occupies in device memory (HBM), from its
shape text alone: `bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)}`.

    device_bytes("bf16[16,128,64]{2,1,0:T(8,128)(2,1)}")    # 16 * 128 * 128 * 2: tiles padded
    device_bytes("bf16[16,128,64]{2,1,0:T(8,128)S(1)}")     # 0: on-chip memory, not HBM

Two facts of a layout count (both appear in TPU programs; GPU programs carry neither, and
their arrays count dtype bytes times elements):
  * Memory space `S(n)`: only space 0, the device's main memory, is HBM traffic. A TPU
    compiler places buffers in its on-chip vector memory (VMEM, `S(1)`: memory-space
    assignment prefetches them there and evicts them back) and scalars and semaphores in
    other spaces; a kernel's reads and writes of those do not touch HBM.
  * Tiles `T(a,b)`: the array is stored in whole tiles of its minor-most dimensions (in the
    layout's minor-to-major order), so a dimension is padded to a multiple of its tile, e.g.
    d = 64 stored in 128 lanes. Sub-tiles after the first `T(...)` (bfloat16's (2,1) packing)
    change no size.
"""
import math
import re
from typing import List, Tuple

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# One array of a shape: dtype, dims, then its layout in braces if written.
ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def arrays(shape: str) -> List[str]:
  """Each array of a shape text, a tuple's flattened in order."""
  return [found.group(0) for found in ARRAY.finditer(shape)]


def memory_space(array: str) -> int:
  """The array's memory space: `S(n)` in its layout, else 0 (the device's main memory)."""
  found = re.search(r"S\((\d+)\)", array)
  return int(found.group(1)) if found else 0


def _layout(array: str) -> Tuple[List[int], List[int], List[int]]:
  """(dims, minor-to-major order, first tile's dims) of one array."""
  dtype_dims_layout = ARRAY.match(array)
  dims = [int(d) for d in dtype_dims_layout.group(2).split(",") if d]
  layout = dtype_dims_layout.group(3) or ""
  order = re.match(r"\{([0-9,]*)", layout)
  minor_to_major = ([int(d) for d in order.group(1).split(",") if d] if order and order.group(1)
                    else list(range(len(dims) - 1, -1, -1)))
  tile = re.search(r"T\(([0-9,]+)\)", layout)
  return dims, minor_to_major, [int(t) for t in tile.group(1).split(",")] if tile else []


def stored_bytes(array: str) -> float:
  """One array's bytes in whichever memory holds it, its dimensions padded to whole tiles."""
  dims, minor_to_major, tile = _layout(array)
  padded = list(dims)
  # The tile's last dimension is the array's minor-most, its first the k-th most minor.
  for tile_dim, dim in zip(reversed(tile), minor_to_major):
    padded[dim] = -(-padded[dim] // tile_dim) * tile_dim
  return DTYPE_BYTES.get(ARRAY.match(array).group(1), 4) * math.prod(padded)


def device_bytes(shape: str) -> float:
  """A shape's bytes in the device's main memory: its arrays in memory space 0, tiles padded;
  a tuple's arrays added up."""
  return sum(stored_bytes(a) for a in arrays(shape) if memory_space(a) == 0)

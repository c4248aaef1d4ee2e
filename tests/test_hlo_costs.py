"""simplified_flax/aot/hlo_costs.py: a kernel's FLOPs, bytes and runs read from optimized HLO."""
import sys

import jax
import jax.numpy as jnp

from test_loop import REPO

sys.path.insert(0, str(REPO))
from simplified_flax.aot import hlo_costs
from simplified_flax.fast import relu_matmul_kernel


def test_hlo_costs_count_matmuls_and_loop_trips():
  def f(x_MK, w_KN):
    def body(carry, _):
      return jnp.tanh(carry @ w_KN), None
    return jax.lax.scan(body, x_MK, None, length=5)[0]

  x_MK, w_KN = jnp.ones((16, 32)), jnp.ones((32, 32))
  program = hlo_costs.parse(jax.jit(f).lower(x_MK, w_KN).compile().as_text())
  matmuls = [k for k in program.kernels.values() if k.is_matmul]
  assert sum(k.flops * k.runs for k in matmuls) == 5 * 2 * 16 * 32 * 32
  assert all(k.runs == 5 and k.bytes >= 4 * (16 * 32 + 32 * 32 + 16 * 32) for k in matmuls)
  assert program.module.startswith("jit_f")


def test_hlo_costs_leave_a_gemm_workspace_out():
  """A cuBLAS GEMM returns (result, s8 workspace): only the result counts, FLOPs and bytes."""
  hlo = """HloModule jit_g, entry_computation_layout={(bf16[64,32]{1,0}, bf16[32,16]{1,0})->bf16[64,16]{1,0}}

ENTRY %main (x: bf16[64,32], w: bf16[32,16]) -> bf16[64,16] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %gemm = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %out = bf16[64,16]{1,0} get-tuple-element(%gemm), index=0
}
"""
  gemm = hlo_costs.parse(hlo).kernels["gemm"]
  assert gemm.is_matmul
  assert gemm.flops == 2 * 64 * 16 * 32
  assert gemm.bytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)


def test_hlo_costs_count_a_pallas_gemm_by_its_name_scope_and_no_other_triton_call():
  """A Triton call carries no cost: the project's Pallas GEMMs (scope `pallas_gemm...`: [M, K]
  input first, [M, N] result) count 2 M N K FLOPs as matmuls; any other counts its bytes."""
  call = ('%{name} = bf16[64,48]{{1,0}} custom-call(%g, %w, %h), custom_call_target='
          '"__gpu$xla.gpu.triton", metadata={{op_name="jit(f)/mlp/c_proj/{scope}/pallas_call"}}')
  hlo = f"""HloModule jit_f, entry_computation_layout={{(bf16[64,32]{{1,0}}, bf16[48,32]{{1,0}}, bf16[64,48]{{1,0}})->(bf16[64,48]{{1,0}}, bf16[64,48]{{1,0}})}}

ENTRY %main (g: bf16[64,32], w: bf16[48,32], h: bf16[64,48]) -> (bf16[64,48], bf16[64,48]) {{
  %g = bf16[64,32]{{1,0}} parameter(0)
  %w = bf16[48,32]{{1,0}} parameter(1)
  %h = bf16[64,48]{{1,0}} parameter(2)
  {call.format(name="gemm", scope=relu_matmul_kernel.NAME)}
  {call.format(name="other", scope="combine")}
  ROOT %out = (bf16[64,48]{{1,0}}, bf16[64,48]{{1,0}}) tuple(%gemm, %other)
}}
"""
  kernels = hlo_costs.parse(hlo).kernels
  assert kernels["gemm"].is_matmul and kernels["gemm"].flops == 2 * 64 * 48 * 32
  assert not kernels["other"].is_matmul and kernels["other"].flops == 0
  assert kernels["gemm"].bytes == kernels["other"].bytes == 2 * (64 * 32 + 48 * 32 + 2 * 64 * 48)


def test_hlo_costs_count_an_in_place_update_as_its_slice():
  """A scan's stacked output is a dynamic-update-slice into its buffer, per step: the step
  reads and writes its slice, never the whole [steps, ...] buffer."""
  def f(x_N):
    return jax.lax.scan(lambda c, _: (jnp.sin(c), jnp.cos(c)), x_N, None, length=64)[1]

  program = hlo_costs.parse(jax.jit(f).lower(jnp.ones(4096)).compile().as_text())
  updates = [k for k in program.kernels.values()   # each step's write into the stacked output
             if k.runs == 64 and hlo_costs.shape_elements(k.shape) == 64 * 4096]
  assert updates
  step_bytes, buffer_bytes = 4 * 4096, 4 * 64 * 4096
  assert all(k.bytes <= 4 * step_bytes < buffer_bytes for k in updates)


def test_hlo_costs_count_a_slice_read_as_the_slice():
  """A scan reading one step of a stacked input per trip (as a scanned model's backward reads
  its residuals) reads that step's slice, never the whole [steps, ...] buffer."""
  def f(xs_SN):
    return jax.lax.scan(lambda c, x_N: (c + jnp.sin(x_N), None), jnp.zeros(4096), xs_SN)[0]

  program = hlo_costs.parse(jax.jit(f).lower(jnp.ones((64, 4096))).compile().as_text())
  step_bytes, buffer_bytes = 4 * 4096, 4 * 64 * 4096
  per_trip = [k for k in program.kernels.values() if k.runs == 64]
  assert per_trip
  assert sum(k.bytes for k in per_trip) <= 8 * step_bytes < buffer_bytes


def test_hlo_costs_see_a_bitcast_buffer_as_the_same_buffer():
  """XLA:GPU stores a scanned model's residuals in a layout of its choosing and updates or
  reads them through a bitcast: still an in-place update, a slice read (the [17, 64, 32]
  buffers below count their [64, 32] slice, never the whole 17 steps)."""
  hlo = """HloModule jit_h, entry_computation_layout={(s32[], f32[17,32,64]{2,1,0}, f32[64,32]{1,0})->(f32[17,64,32]{2,1,0}, f32[1,64,32]{2,1,0})}

%fused_update (p0: s32[], p1: f32[17,32,64], p2: f32[64,32]) -> f32[17,64,32] {
  %p1 = f32[17,32,64]{1,2,0} parameter(1)
  %b = f32[17,64,32]{2,1,0} bitcast(%p1)
  %p2 = f32[64,32]{1,0} parameter(2)
  %u = f32[1,64,32]{2,1,0} bitcast(%p2)
  %p0 = s32[] parameter(0)
  %z = s32[] constant(0)
  ROOT %dus = f32[17,64,32]{2,1,0} dynamic-update-slice(%b, %u, %p0, %z, %z)
}

%fused_read (q0: s32[], q1: f32[17,32,64]) -> f32[1,64,32] {
  %q1 = f32[17,32,64]{1,2,0} parameter(1)
  %c = f32[17,64,32]{2,1,0} bitcast(%q1)
  %q0 = s32[] parameter(0)
  %y = s32[] constant(0)
  %rs = f32[1,64,32]{2,1,0} dynamic-slice(%c, %q0, %y, %y), dynamic_slice_sizes={1,64,32}
  ROOT %neg = f32[1,64,32]{2,1,0} negate(%rs)
}

ENTRY %main (i: s32[], buffer: f32[17,32,64], x: f32[64,32]) -> (f32[17,64,32], f32[1,64,32]) {
  %i = s32[] parameter(0)
  %buffer = f32[17,32,64]{1,2,0} parameter(1)
  %x = f32[64,32]{1,0} parameter(2)
  %update = f32[17,64,32]{2,1,0} fusion(%i, %buffer, %x), kind=kLoop, calls=%fused_update
  %read = f32[1,64,32]{2,1,0} fusion(%i, %buffer), kind=kLoop, calls=%fused_read
  ROOT %out = (f32[17,64,32]{2,1,0}, f32[1,64,32]{2,1,0}) tuple(%update, %read)
}
"""
  kernels = hlo_costs.parse(hlo).kernels
  slice_bytes = 4 * 64 * 32
  assert kernels["update"].bytes == 3 * slice_bytes + 4   # read x, read + write the slice; i
  assert kernels["read"].bytes == 2 * slice_bytes + 4     # read the slice, write the result; i


def test_hlo_costs_count_hbm_traffic_of_a_tpu_program():
  """A TPU program keeps buffers in on-chip VMEM (`S(1)`), prefetching them and evicting them
  with asynchronous copies (result: destination, source alias, context) and weight rows with
  asynchronous slices, and stores arrays in (8, 128) tiles: only HBM traffic counts, each
  transfer once, d = 64 padded to 128 lanes."""
  hlo = """HloModule jit_t, entry_computation_layout={(bf16[16,128,64]{2,1,0:T(8,128)(2,1)}, f32[1024,768]{1,0:T(8,128)})->(bf16[16,128,64]{2,1,0:T(8,128)(2,1)}, f32[256,768]{1,0:T(8,128)S(1)})}

%fused_double (p0: bf16[16,128,64]) -> bf16[16,128,64] {
  %p0 = bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %sum = bf16[16,128,64]{2,1,0:T(8,128)(2,1)} add(%p0, %p0)
}

%fused_square (p0: bf16[16,128,64]) -> bf16[16,128,64] {
  %p0 = bf16[16,128,64]{2,1,0:T(8,128)(2,1)} parameter(0)
  ROOT %product = bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)} multiply(%p0, %p0)
}

ENTRY %main (x: bf16[16,128,64], w: f32[1024,768]) -> (bf16[16,128,64], f32[256,768], bf16[16,128,64]) {
  %x = bf16[16,128,64]{2,1,0:T(8,128)(2,1)} parameter(0)
  %w = f32[1024,768]{1,0:T(8,128)} parameter(1)
  %prefetch = (bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)}, bf16[16,128,64]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x)
  %x_vmem = bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)} copy-done(%prefetch)
  %doubled = bf16[16,128,64]{2,1,0:T(8,128)(2,1)} fusion(%x_vmem), kind=kLoop, calls=%fused_double
  %rows = ((f32[1024,768]{1,0:T(8,128)}), f32[256,768]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:256], [0:768]}
  %rows_vmem = f32[256,768]{1,0:T(8,128)S(1)} slice-done(%rows)
  %squared = bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)} fusion(%x), kind=kLoop, calls=%fused_square
  %evict = (bf16[16,128,64]{2,1,0:T(8,128)(2,1)}, bf16[16,128,64]{2,1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%squared)
  %squared_hbm = bf16[16,128,64]{2,1,0:T(8,128)(2,1)} copy-done(%evict)
  ROOT %out = (bf16[16,128,64]{2,1,0:T(8,128)(2,1)}, f32[256,768]{1,0:T(8,128)S(1)}, bf16[16,128,64]{2,1,0:T(8,128)(2,1)}) tuple(%doubled, %rows_vmem, %squared_hbm)
}
"""
  kernels = hlo_costs.parse(hlo).kernels
  x_in_lanes = 16 * 128 * 128 * 2   # [16, 128, 64] bfloat16, 64 padded to 128 lanes
  assert kernels["prefetch"].bytes == x_in_lanes   # read from HBM once, written to VMEM
  assert kernels["doubled"].bytes == x_in_lanes    # reads VMEM, writes HBM
  assert kernels["rows"].bytes == 256 * 768 * 4    # the slice, not the whole [1024, 768]
  assert kernels["squared"].bytes == x_in_lanes    # reads HBM, writes VMEM
  assert kernels["evict"].bytes == x_in_lanes      # read from VMEM, written to HBM once
  assert kernels["x_vmem"].bytes == kernels["rows_vmem"].bytes == 0
  assert kernels["squared_hbm"].bytes == 0


def test_hlo_costs_count_an_embedding_lookup_as_the_rows_it_reads():
  """A gather from a [V, D] table reads the N rows it gathers, not the whole table."""
  def f(table_VD, tokens_N):
    return jnp.take(table_VD, tokens_N, axis=0) * 2.0

  table_VD, tokens_N = jnp.ones((4096, 64)), jnp.arange(32)
  program = hlo_costs.parse(jax.jit(f).lower(table_VD, tokens_N).compile().as_text())
  table_bytes, rows_bytes = 4 * 4096 * 64, 4 * 32 * 64
  total = sum(k.bytes * k.runs for k in program.kernels.values())
  assert rows_bytes < total < table_bytes


def test_hlo_costs_count_a_tpu_batched_matmul_written_as_a_dilated_window():
  """A TPU writes attention's logits einsum (batch and heads as batch dimensions) as a
  convolution whose window has lhs_dilate equal to its size: one tap per output lands on an
  input element, so it costs 2 * outputs * d, not that times the window's 16 x 12 taps."""
  hlo = """HloModule jit_logits, entry_computation_layout={(bf16[16,128,12,64]{1,3,2,0:T(8,128)(2,1)}, bf16[16,128,12,64]{1,3,2,0:T(8,128)(2,1)})->f32[16,12,128,128]{2,3,1,0:T(8,128)}}

ENTRY %main (q: bf16[16,128,12,64], k: bf16[16,128,12,64]) -> f32[16,12,128,128] {
  %q = bf16[16,128,12,64]{1,3,2,0:T(8,128)(2,1)} parameter(0)
  %k = bf16[16,128,12,64]{1,3,2,0:T(8,128)(2,1)} parameter(1)
  ROOT %logits = f32[16,12,128,128]{2,3,1,0:T(8,128)} convolution(%q, %k), window={size=16x12 stride=15x11 lhs_dilate=16x12}, dim_labels=0b1f_0o1i->01bf
}
"""
  logits = hlo_costs.parse(hlo).kernels["logits"]
  assert logits.is_matmul
  assert logits.flops == 2 * (16 * 12 * 128 * 128) * 64


def test_hlo_costs_count_a_scatter_as_its_rows_and_read_a_loop_bound_without_a_trip_count():
  """A scatter-add (an embedding's gradient) writes its updates' rows into its buffer in
  place: it reads and writes those rows, never the whole [V, D] table. And a loop that XLA:TPU
  leaves without `known_trip_count` runs as often as its condition's `i < N` says."""
  hlo = """HloModule jit_s, entry_computation_layout={(f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0})->f32[1000,64]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_scatter (p0: f32[1000,64], p1: s32[8,1], p2: f32[8,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %p2 = f32[8,64]{1,0} parameter(2)
  ROOT %scatter = f32[1000,64]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%body (s: (s32[], f32[1000,64], s32[8,1], f32[8,64])) -> (s32[], f32[1000,64], s32[8,1], f32[8,64]) {
  %s = (s32[], f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %table = f32[1000,64]{1,0} get-tuple-element(%s), index=1
  %ids = s32[8,1]{1,0} get-tuple-element(%s), index=2
  %rows = f32[8,64]{1,0} get-tuple-element(%s), index=3
  %update = f32[1000,64]{1,0} fusion(%table, %ids, %rows), kind=kLoop, calls=%fused_scatter
  ROOT %out = (s32[], f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0}) tuple(%next, %update, %ids, %rows)
}

%cond (c: (s32[], f32[1000,64], s32[8,1], f32[8,64])) -> pred[] {
  %c = (s32[], f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0}) parameter(0)
  %n = s32[] constant(5)
  %counter = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%counter, %n), direction=LT
}

ENTRY %main (t: f32[1000,64], x: s32[8,1], u: f32[8,64]) -> f32[1000,64] {
  %t = f32[1000,64]{1,0} parameter(0)
  %x = s32[8,1]{1,0} parameter(1)
  %u = f32[8,64]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0}) tuple(%zero, %t, %x, %u)
  %loop = (s32[], f32[1000,64]{1,0}, s32[8,1]{1,0}, f32[8,64]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %result = f32[1000,64]{1,0} get-tuple-element(%loop), index=1
}
"""
  update = hlo_costs.parse(hlo).kernels["update"]
  rows_bytes = 4 * 8 * 64
  assert update.bytes == 3 * rows_bytes + 4 * 8   # read the updates, read + write the rows; ids
  assert update.runs == 5


def test_collectives_count_the_whole_arrays_they_reduce_or_gather():
  """aot/collectives.py: an all-reduce counts its result, an asynchronous all-gather its
  result at the start, a reduce-scatter its operand, and XLA:TPU's all-reduce-scatter fusion
  is a reduce-scatter of the arrays its all-reduce carries."""
  from simplified_flax.aot import collectives  # pylint: disable=import-outside-toplevel
  hlo = """HloModule jit_c, entry_computation_layout={(bf16[64,32]{1,0}, f32[8,32]{1,0}, bf16[64,32]{1,0})->(bf16[64,32]{1,0}, f32[64,32]{1,0}, bf16[8,32]{1,0}, bf16[8,32]{1,0})}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

%all-reduce-scatter.1 (input_0: bf16[64,32]) -> bf16[8,32] {
  %input_0 = bf16[64,32]{1,0} parameter(0)
  %reduced = bf16[64,32]{1,0} all-reduce(%input_0), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %zero = u32[] constant(0)
  %id = u32[] partition-id()
  %eight = u32[] constant(8)
  %offset = u32[] multiply(%id, %eight)
  ROOT %mine = bf16[8,32]{1,0} dynamic-slice(%reduced, %offset, %zero), dynamic_slice_sizes={8,32}
}

ENTRY %main (g: bf16[64,32], w: f32[8,32], h: bf16[64,32]) -> (bf16[64,32], f32[64,32], bf16[8,32], bf16[8,32]) {
  %g = bf16[64,32]{1,0} parameter(0)
  %w = f32[8,32]{1,0} parameter(1)
  %h = bf16[64,32]{1,0} parameter(2)
  %summed = bf16[64,32]{1,0} all-reduce(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %start = (f32[8,32]{1,0}, f32[64,32]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %gathered = f32[64,32]{1,0} all-gather-done(%start)
  %scattered = bf16[8,32]{1,0} reduce-scatter(%h), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %fused = bf16[8,32]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %out = (bf16[64,32]{1,0}, f32[64,32]{1,0}, bf16[8,32]{1,0}, bf16[8,32]{1,0}) tuple(%summed, %gathered, %scattered, %fused)
}
"""
  found = collectives.collective_bytes(hlo_costs.parse(hlo))
  assert found == {"all-reduce": 64 * 32 * 2, "all-gather": 64 * 32 * 4,
                   "reduce-scatter": 2 * 64 * 32 * 2}

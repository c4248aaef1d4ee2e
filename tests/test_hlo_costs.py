"""simplified_flax/aot/hlo_costs.py: a kernel's FLOPs, bytes and runs read from optimized HLO."""
import sys

import jax
import jax.numpy as jnp

from test_loop import REPO

sys.path.insert(0, str(REPO))
from simplified_flax.aot import hlo_costs


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

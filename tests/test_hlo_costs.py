"""experiments/hlo_costs.py: a kernel's FLOPs, bytes and runs read from optimized HLO."""
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

"""The TPU splash kernel under a multi-device jit mesh: `shard_map`ped over the batch (and, where
the batch runs out, the heads), equal to the explicit form in outputs and gradients. Runs in a
child process on 8 simulated CPU devices, the kernel in Pallas interpret mode; so are the
causal combine's kernels (fast/combine_kernel.py, the GPU's and the TPU's), with the batch and
the heads split. Each case runs `fast.attention.shaped_attention` under an explicit plan."""
import json
import subprocess
import sys

import jax
import numpy as np

from simplified_flax.fast import attention_kernels
from test_loop import REPO, subprocess_env

SCRIPT = r"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import grad_rules
from simplified_flax.fast.plan import Plan
from simplified_flax.training import placement

T, H, DH = 128, 2, 8
GAINS = dict(resid_gain=jnp.array([1.0, 0.5]), skip_gain=jnp.array([0.3, 1.0]),
             centre_gain=jnp.array([0.9, 0.2]))
mesh = placement.make_mesh(fsdp=2)   # ("data": 4, "fsdp": 2)
# A TPU's plan without rules: the splash kernel (interpreted) and XLA's combine.
SPLASH = Plan("tpu", frozenset(), "fused", interpret=True)
# Every rule on a GPU's plan, interpreted: XLA's A v (float32) and the GPU's combine kernels.
GPU_COMBINE = Plan("gpu", frozenset(grad_rules.AUTO_PLATFORM), "fused", interpret=True)
# "auto" on a TPU, interpreted: the splash kernel and the TPU's own combine kernels.
TPU_COMBINE = Plan("tpu", frozenset(rule for rule, platforms in grad_rules.AUTO_PLATFORM.items()
                                    if "tpu" in platforms), "fused", interpret=True)

def step(plan, impl, causal):
  def value_and_grad(gains, batch, axis_name=None):
    def loss(gains, q, k, v):
      out = fast_attention.shaped_attention(plan, q, k, v, causal=causal, impl=impl, **gains)
      return jnp.sum(jnp.sin(out))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(gains, *batch)
  return value_and_grad

def qkv(batch):
  keys = jax.random.split(jax.random.key(batch), 3)
  return [jax.random.normal(key, (batch, T, H, DH)) for key in keys]

out = {}
# The training path: JitPlacement's step over the mesh, 8 rows (one per device).
jit_placement = placement.JitPlacement(8, mesh)
batch = jax.device_put(qkv(8), placement.batch_sharding(mesh))
abstract = jax.eval_shape(lambda: GAINS)
for causal in (True, False):
  run = lambda impl: jit_placement.compile_step(step(SPLASH, impl, causal), abstract,
                                                returns_state=False)(GAINS, batch)
  out[f"rows_causal{causal}"] = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                              run("fused"), run("explicit"))
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
  out["jaxpr_has_shard_map"] = "shard_map" in str(jax.make_jaxpr(step(SPLASH, "fused", True))(
      GAINS, batch))
# 4 rows: the batch splits over "data", the heads over "fsdp".
batch = jax.device_put(qkv(4), NamedSharding(mesh, P("data")))
def under_mesh(plan, impl):
  def f(gains, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return step(plan, impl, True)(gains, batch)
  return jax.jit(f)(GAINS, batch)
differences = lambda plan: jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                        under_mesh(plan, "fused"), under_mesh(plan, "explicit"))
out["heads"] = differences(SPLASH)
# The causal combine's kernels (the GPU's, interpreted here), split over the heads too.
out["heads_combine_kernels"] = differences(GPU_COMBINE)
out["jaxpr_has_combine_kernels"] = "pallas_call" in str(
    jax.make_jaxpr(step(GPU_COMBINE, "fused", True))(GAINS, batch))
# The TPU's own combine kernels (what "auto" takes when compiling for a TPU), interpreted.
out["heads_tpu_combine_kernels"] = differences(TPU_COMBINE)
out["jaxpr_has_tpu_combine_kernels"] = "shaped_combine_backward" in str(
    jax.make_jaxpr(step(TPU_COMBINE, "fused", True))(GAINS, batch))
print("RESULT " + json.dumps(out))
"""


def test_mesh_split_gives_axes_to_the_batch_then_the_heads():
  split = attention_kernels.mesh_split
  assert split((("data", 4), ("fsdp", 2)), 8, 12) == (("data", "fsdp"), ())
  assert split((("data", 4), ("fsdp", 2)), 4, 12) == (("data",), ("fsdp",))
  assert split((("data", 8), ("fsdp", 1)), 2, 16) == ((), ("data",))
  assert split((("data", 8),), 3, 5) == ((), ())   # neither divides: repeated, not split


def test_tokens_per_device_divides_by_the_axes_that_split_the_batch():
  """What the attention sub-block reads to choose its q/k form (fast/block.py): off a mesh every
  token; under one, the batch's share as `mesh_split` gives it (not the heads')."""
  assert attention_kernels.tokens_per_device(8, 128, 2) == 1024
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "fsdp"),
                                   axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.sharding.use_abstract_mesh(mesh):
    assert attention_kernels.tokens_per_device(8, 128, 12) == 128    # data and fsdp
    assert attention_kernels.tokens_per_device(4, 128, 12) == 128    # data; fsdp on heads
    assert attention_kernels.tokens_per_device(3, 128, 5) == 384     # neither divides


def test_splash_under_an_eight_device_mesh_equals_explicit():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=subprocess_env(devices=8),
                        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.split("RESULT ", 1)[1])
  assert out.pop("jaxpr_has_shard_map") and out.pop("jaxpr_has_combine_kernels")
  assert out.pop("jaxpr_has_tpu_combine_kernels")
  for case, (value_diff, grad_diffs) in out.items():
    assert value_diff < 1e-3, case   # a sum over 8 x 128 x 2 x 8 outputs
    np.testing.assert_array_less(np.array(jax.tree.leaves(grad_diffs)), 1e-3, err_msg=case)


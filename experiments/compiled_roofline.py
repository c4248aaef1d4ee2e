"""Roofline of the train step compiled deviceless for an accelerator, from its optimized HLO.

    python experiments/compiled_roofline.py --target=h200 --configs=preln,sas,sas_p,sas_p_nonorm
    python experiments/compiled_roofline.py --target=v5e-8 --configs=preln,sas_p

The step is built as training builds it (config, abstract state, `JitPlacement.compile_step`)
at the paper shape (the configs' defaults, bfloat16, V = 50,257) and compiled for the target
with no device present. Per kernel (hlo_costs.py): roofline = max(FLOPs / peak, bytes / HBM
bandwidth), summed; "non-matmul" bytes are those of kernels without a matmul. `--parts` also
splits the non-matmul bytes by scope (blocks forward / backward, loss, optimizer, other).
H200: the GpuTargetConfig text at `--gpu_target` (e.g. /tmp/aot/h200.txtpb). v5e-8: XLA's
cost_analysis per chip. While tracing, `jax.default_backend()` answers the target's platform
so that the model picks the paths it would pick there (cuDNN / splash attention).
"""
import argparse
import os
import re
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # a deviceless TPU compile holds no chip
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top,wrong-import-position

import configs  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import hlo_costs  # pylint: disable=g-import-not-at-top,wrong-import-position
from simplified_flax.training import placement, step  # pylint: disable=g-import-not-at-top,wrong-import-position

H200_PEAK_FLOPS, H200_BYTES_PER_S = 989e12, 4.8e12


def topology(target: str, gpu_target: str):
  if target == "h200":
    return topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                        target_config=open(gpu_target).read()), "gpu"
  assert target == "v5e-8", target
  return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4"), "tpu"


def compile_train_step(name: str, topo, platform: str, overrides=None):
  """The compiled train step of config `name` at the paper shape, for `topo`'s devices."""
  config = configs.load(name, {"dtype": "bfloat16", "model.vocab_size": 50257,
                               **(overrides or {})})
  mesh = placement.make_mesh(1, devices=topo.devices)
  real_backend = jax.default_backend
  jax.default_backend = lambda: platform   # the model's path choice reads it while tracing
  try:
    abstract = jax.eval_shape(lambda r: step.create_train_state(config, r),
                              jax.ShapeDtypeStruct((2,), jnp.uint32))
    runner = placement.JitPlacement(config.batch_size, mesh)
    fn = runner.compile_step(step.train_step, abstract)
    shardings = placement.state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.model.context_length), jnp.int32,
                                  sharding=placement.batch_sharding(mesh))
    return fn.lower(abstract, {"inputs": tokens}).compile()
  finally:
    jax.default_backend = real_backend


def scope_of(op_name: str) -> str:
  """Which part of the step an instruction's op_name belongs to."""
  if "optimizer" in op_name:
    return "optimizer"
  if re.search(r"\bloss\b", op_name):
    return "loss bwd" if "transpose(" in op_name else "loss fwd"
  if re.search(r"/h_\d+/", op_name):
    return "blocks bwd" if "transpose(" in op_name else "blocks fwd"
  return "other"


def summary(compiled) -> dict:
  program = hlo_costs.parse(compiled.as_text())
  row = dict(flops=0.0, bytes=0.0, nonmatmul=0.0, seconds=0.0, parts={})
  for k in program.kernels.values():
    flops, nbytes = k.flops * k.runs, k.bytes * k.runs
    row["flops"] += flops
    row["bytes"] += nbytes
    row["seconds"] += max(flops / H200_PEAK_FLOPS, nbytes / H200_BYTES_PER_S)
    if not k.is_matmul:
      row["nonmatmul"] += nbytes
      part = scope_of(k.op_name)
      row["parts"][part] = row["parts"].get(part, 0.0) + nbytes
  return row


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--target", default="h200", choices=("h200", "v5e-8"))
  parser.add_argument("--configs", default="preln,sas,sas_p,sas_p_nonorm")
  parser.add_argument("--gpu_target", default="/tmp/aot/h200.txtpb")
  parser.add_argument("--parts", action="store_true")
  parser.add_argument("--dump", default="", help="folder to write each optimized HLO to")
  args = parser.parse_args()
  topo, platform = topology(args.target, args.gpu_target)
  base = None
  for name in args.configs.split(","):
    compiled = compile_train_step(name, topo, platform)
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      with open(os.path.join(args.dump, f"{name}.{args.target}.hlo"), "w") as f:
        f.write(compiled.as_text())
    if args.target == "v5e-8":
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      print(f"{name}: per chip {cost['flops'] / 1e12:.2f} TFLOP, "
            f"{cost['bytes accessed'] / 1e9:.2f} GB", flush=True)
      continue
    row = summary(compiled)
    base = base or row["seconds"]
    print(f"| {name} | {row['flops'] / 1e12:.2f} | {row['bytes'] / 1e9:.1f} | "
          f"{row['nonmatmul'] / 1e9:.1f} | {row['seconds'] * 1e3:.1f} | "
          f"{base / row['seconds']:.3f} |", flush=True)
    if args.parts:
      print("   ", {p: round(b / 1e9, 1) for p, b in sorted(row["parts"].items())}, flush=True)


if __name__ == "__main__":
  main()

"""`python -m simplified_flax.compile`: a tiny model's steps compiled, on this CPU, for a 4-chip
TPU v5e (libtpu) and an H100 (jax's CUDA plugin), with no accelerator (docs/compile.md, "Compiling
for an accelerator"). Tests that need a compiler skip where it is missing, and fail instead
under SIMPLIFIED_FLAX_REQUIRE_AOT=1 (CI's accelerator-compiler step)."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from simplified_flax.aot import hlo_costs
from simplified_flax.aot import programs
from simplified_flax.aot import report
from simplified_flax import fast
from simplified_flax.aot import targets
from simplified_flax.fast import block as fast_block
from simplified_flax.fast import relu_matmul_kernel
from simplified_flax.fast import target_platform
from test_loop import REPO, subprocess_env

pytestmark = pytest.mark.aot
TINY = {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.context_length": 128,
        "model.vocab_size": 97, "batch_size": 8, "dtype": "bfloat16"}


def _needs(platform: str) -> None:
  if targets._installed(platform):  # pylint: disable=protected-access
    return
  extra = targets.TPU_EXTRA if platform == "tpu" else targets.GPU_EXTRA
  why = f"the {platform} compiler is not installed (pip install 'simplified_flax[{extra}]')"
  if os.environ.get("SIMPLIFIED_FLAX_REQUIRE_AOT"):
    pytest.fail(why)
  pytest.skip(why)


def _tiny(variant="sas_p", **overrides):
  from simplified_flax import configs  # pylint: disable=import-outside-toplevel
  return configs.load(variant, dict(TINY, **overrides))


@pytest.fixture(scope="module")
def tpu_steps():
  _needs("tpu")
  return programs.compile_for(_tiny(), targets.parse("v5e-4"))


@pytest.fixture(scope="module")
def gpu_steps():
  _needs("gpu")
  return programs.compile_for(_tiny(), targets.parse("h100"))


def test_a_tpu_program_compiled_on_a_cpu_host_holds_splash_under_shard_map(tpu_steps):
  assert jax.default_backend() == "cpu"
  hlo = tpu_steps.train.as_text()
  assert report.attention_kernel(hlo) == "splash"
  assert report.attention_kernel(tpu_steps.eval.as_text()) == "splash"
  assert len(tpu_steps.devices) == 4 and tpu_steps.devices[0].platform == "tpu"
  # The batch is split over the 4 chips: each runs the kernel on its own 2 rows.
  assert "bf16[2,2,128,32]" in hlo or "bf16[2,128,2,32]" in hlo
  # SAS-P's causal combine: the TPU's own Mosaic kernels (fast/combine_kernel_tpu.py), each way.
  assert "shaped_combine_forward" in hlo and "shaped_combine_backward" in hlo


def test_the_tied_embedding_gradient_is_all_reduced_once(tpu_steps):
  """The lookup's and the head's float32 [V, D] gradients are added on each chip and summed
  over the data axis in one all-reduce (fast/layers.py, `embedding_lookup`), not reduced,
  scattered into and reduced again."""
  table = f"f32[{TINY['model.vocab_size']},{TINY['model.n_embd']}]"
  results = [found.group(1) for found in re.finditer(r"= (.*) all-reduce(?:-start)?\(",
                                                      tpu_steps.train.as_text())]
  assert sum(shapes.count(table) for shapes in results) == 1


def test_the_lookups_gradient_is_scattered_into_the_heads_in_place(tpu_steps):
  """Through each chip's copy of the table (fast.layers.table_copies), the lookup's rows are
  scatter-added into the head's partial gradient, not into a zeroed [V, D] table first."""
  program = hlo_costs.parse(tpu_steps.train.as_text())
  table = f"f32[{TINY['model.vocab_size']},{TINY['model.n_embd']}]"
  scatters = [k for k in program.kernels.values()
              if "/wte/" in k.op_name and "scatter" in k.op_name and k.shape.startswith(table)
              and k.opcode in ("scatter", "fusion")]
  assert len(scatters) == 1
  read = [program.instructions[name].op_name for name in scatters[0].operands]
  assert any("transpose(jvp(loss))" in op_name for op_name in read), read


def test_each_chip_updates_its_slice_of_the_weights():
  """parallel.shard_update (training/placement.py): a large weight's optimiser state is split
  over the 4 chips, and the step all-gathers the new weights, which the state keeps whole."""
  _needs("tpu")
  steps = programs.compile_for(_tiny(**{"parallel.shard_update": True}),
                               targets.parse("v5e-4"))
  kernel = [x for path, x in jax.tree_util.tree_leaves_with_path(steps.abstract_state)
            if re.search(r"\bmu\b.*'h_0'.*'c_fc'.*'kernel'|params.*'h_0'.*'c_fc'.*'kernel'",
                         jax.tree_util.keystr(path))]
  params_leaf, mu_leaf = sorted(kernel, key=lambda x: "data" in str(x.sharding.spec))
  assert params_leaf.sharding.shard_shape(params_leaf.shape) == (64, 256)
  assert mu_leaf.sharding.shard_shape(mu_leaf.shape) == (64, 64)
  assert re.search(r"= f32\[64,256\]\S* all-gather(?:-start)?\(", steps.train.as_text())
  assert report.summarize(steps, steps.config)["collective_bytes_per_device"]["all-gather"] > 0


def test_a_gpu_program_calls_cudnn_attention(gpu_steps):
  hlo = gpu_steps.train.as_text()
  assert "__cudnn$fmhaSoftmax" in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo
  assert report.attention_kernel(hlo) == "cudnn"


@pytest.mark.parametrize("min_tokens", [None, 1024])
def test_a_gpu_program_makes_q_and_k_apart_where_each_device_has_the_tokens(
    gpu_steps, monkeypatch, min_tokens):
  """grad_rules' split rule on a GPU, for the tiny step's 1,024 tokens a device: under
  `fast.block.SEPARATE_QK_MIN_TOKENS` (4,096), the one GEMM's halves, whose backward concatenates
  dq and dk (once); with the threshold at 1,024, a GEMM each, forward and for the input's
  gradient, and a backward that neither concatenates them nor sums them for the bias."""
  steps = gpu_steps
  if min_tokens:
    monkeypatch.setattr(fast_block, "SEPARATE_QK_MIN_TOKENS", min_tokens)
    steps = programs.compile_for(_tiny(), targets.parse("h100"))
  kernels = [k for k in hlo_costs.parse(steps.train.as_text()).kernels.values()
             if "/h_0/attn/c_attn/" in k.op_name]
  backward = [k for k in kernels if "transpose(jvp(" in k.op_name]
  forward = [k for k in kernels if k not in backward]
  concatenations = [k for k in backward if k.op_name.endswith("/concatenate")]
  if not min_tokens:
    assert len(concatenations) == 1 and sum(k.is_matmul for k in forward) < 2
    return
  assert sum(k.is_matmul for k in forward) == 2
  assert sum(k.is_matmul and k.op_name.endswith("/dot_general") for k in backward) == 2
  assert not concatenations and not [k for k in backward if k.op_name.endswith("/reduce_sum")]


@pytest.mark.parametrize("num_gpus", [1, 8])
def test_a_gpu_program_takes_the_relus_derivative_inside_the_mlps_gemm(gpu_steps, num_gpus):
  """grad_rules' relu_matmul rule: each layer's dh = (g W_proj^T) * [h >= 0] is one Pallas GEMM
  (on 8 GPUs `shard_map`ped over the batch), counted as a matmul with its FLOPs, and no other
  kernel of the MLP's backward writes [rows, 4D] (XLA's select kernel is gone)."""
  steps = gpu_steps if num_gpus == 1 else programs.compile_for(
      _tiny(), targets.parse("h100", num_gpus=num_gpus))
  kernels = hlo_costs.parse(steps.train.as_text()).kernels.values()
  rows, F, D = TINY["batch_size"] * TINY["model.context_length"] // num_gpus, 4 * 64, 64
  gemms = [k for k in kernels if f"/{relu_matmul_kernel.NAME}/" in k.op_name]
  assert len(gemms) == TINY["model.n_layer"]
  assert all(k.is_matmul and k.flops == 2 * rows * F * D for k in gemms)
  assert all(f"bf16[{rows},{F}]" in k.shape for k in gemms)
  backward = [k for k in kernels if "/mlp/" in k.op_name and "transpose(jvp(" in k.op_name]
  assert not [k for k in backward
              if not k.is_matmul and hlo_costs.shape_elements(k.shape) == rows * F]


def test_the_combine_kernels_compile_for_a_gpu_as_triton_calls():
  """The causal combine's Pallas kernels, forward and backward, without and with a parallel
  block's addend, through XLA:GPU's Triton compiler for an H100 (a tiny model has too few
  (sequence, head) programs to take them)."""
  _needs("gpu")
  from simplified_flax.fast import combine_kernel  # pylint: disable=import-outside-toplevel
  device = targets.topology_devices(targets.parse("h100"))[0]
  B, T, H, d = combine_kernel.MIN_PROGRAMS // 2, 64, 2, 16
  spec = lambda *shape: jax.ShapeDtypeStruct(
      shape, jnp.bfloat16 if len(shape) == 4 else jnp.float32,
      sharding=jax.sharding.SingleDeviceSharding(device))

  def loss(av, v, resid, skip, centre, addend):   # sequential and parallel forms
    sequential = combine_kernel.causal_combine(av, v, resid, skip, centre, True, False)
    parallel = combine_kernel.causal_combine(av, v, resid, skip, centre, True, False, addend)
    return sum(jnp.sum(out.astype(jnp.float32) ** 2) for out in (sequential, parallel))

  grad = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
  hlo = grad.trace(spec(B, T, H, d), spec(B, T, H, d), spec(H), spec(H), spec(H),
                   spec(B, T, H, d)).lower(lowering_platforms=("cuda",)).compile().as_text()
  assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 4


def test_the_json_report_has_every_key_and_consistent_figures(tpu_steps, gpu_steps):
  for steps in (tpu_steps, gpu_steps):
    summary = report.summarize(steps, steps.config)
    assert set(report.KEYS) <= set(summary)
    json.dumps(summary)   # JSON-able as it is
    memory = summary["memory_per_device_bytes"]
    assert set(memory["arguments"]) >= {"params", "optimizer_state", "batch"}
    assert {"temporaries", "outputs", "code"} <= set(memory)
    assert summary["fits"] and memory["total"] < summary["device_memory_bytes"]
    assert summary["flops_per_device"] > 0 and summary["roofline_step_s"] > 0
    assert 0 < summary["mfu_bound"] < 1
    assert "between devices" in report.text(summary)
    assert summary["attention_note"] is None   # both call their kernel
    assert f"kernel {summary['attention_kernel']} (why); " in report.text(
        dict(summary, attention_note="why"))
  tpu = report.summarize(tpu_steps, tpu_steps.config)
  gpu = report.summarize(gpu_steps, gpu_steps.config)
  # Same model and batch: a v5e chip holds a quarter of the rows, and of the FLOPs, plus the
  # TPU form's prefix-sum matmuls (fast.attention.causal_prefix_sums: at most three passes of
  # 2 B T c D per layer, forward and backward; 15% of this tiny model's FLOPs, 0.5% at D=768).
  from simplified_flax.fast import attention  # pylint: disable=import-outside-toplevel
  prefix = 3 * 2 * TINY["batch_size"] * TINY["model.context_length"] * attention.PREFIX_CHUNK \
      * TINY["model.n_embd"] * TINY["model.n_layer"]
  assert 0.95 * gpu["flops_per_device"] <= tpu["flops_per_device"] * 4 \
      <= 1.05 * (gpu["flops_per_device"] + prefix)
  # The gradient is summed over the 4 chips; one GPU has no one to sum with.
  assert tpu["collective_bytes_per_device"]["all-reduce"] > 0
  assert gpu["collective_bytes_per_device"] == {}
  # The float32 master weights: 4 bytes a parameter, replicated on each chip.
  assert tpu["memory_per_device_bytes"]["arguments"]["params"] == \
      gpu["memory_per_device_bytes"]["arguments"]["params"]


@pytest.mark.parametrize("platform, overrides, says", [
    ("gpu", {"dtype": "float32"}, "cuDNN's flash attention takes bfloat16 or float16; "
                                  "--config.dtype=bfloat16 gives it"),
    ("gpu", {"model.attention_impl": "explicit"}, "model.attention_impl=explicit forms"),
    ("tpu", {"model.dot_norm_type": "tanh"}, "soft-caps the logits"),
    ("tpu", {"model.context_length": 96}, "not a multiple of splash's block (128)")])
def test_a_program_without_an_attention_kernel_says_why(platform, overrides, says):
  assert says in report.attention_note(_tiny(**overrides), platform, "xla")
  assert report.attention_note(_tiny(**overrides), platform, "splash") is None
  assert report.attention_note(_tiny(), platform, "xla") is None   # no reason it knows


def test_choices_follow_the_platform_compiled_for_not_the_host():
  """The model a step builds when it is traced (`fast.build_model`, as `fast.ModelApply` calls
  it) follows the platform compiled for: "auto"'s attention form and the rules of its plan."""
  model_config = _tiny().model
  assert model_config.attention_impl == "auto"
  plan = lambda dtype: fast.build_model(model_config, dtype).plan
  with target_platform.compiling_for("tpu"):
    assert plan("float32").platform == "tpu"
    assert plan("float32").attention_impl == "fused"
    assert not plan("float32").applies("dense")
  with target_platform.compiling_for("gpu"):
    assert plan("bfloat16").attention_impl == "fused"
    assert plan("float32").attention_impl == "explicit"
  assert target_platform.current() == "cpu"
  assert plan("float32").platform == "cpu"
  assert plan("float32").attention_impl == "explicit"
  assert plan("float32").applies("dense")


def test_an_explicit_step_for_one_v5e_chip_compiles():
  """libtpu 0.0.42.1 overflowed its compiler fibers' stacks (SIGSEGV) on this step until
  targets.use_libtpu_fiber_stack gave them 16 MiB."""
  _needs("tpu")
  steps = programs.compile_for(_tiny(**{"model.attention_impl": "explicit"}),
                               targets.parse("v5e-1"))
  assert report.attention_kernel(steps.train.as_text()) == "xla"
  assert targets.LIBTPU_FIBER_STACK_FLAG in os.environ["LIBTPU_INIT_ARGS"]


def test_the_fiber_stack_flag_keeps_the_users_libtpu_flags():
  environ = {"LIBTPU_INIT_ARGS": "--xla_tpu_foo=1"}
  targets.use_libtpu_fiber_stack(environ)
  assert environ["LIBTPU_INIT_ARGS"] == (f"--xla_tpu_foo=1 {targets.LIBTPU_FIBER_STACK_FLAG}="
                                         f"{targets.LIBTPU_FIBER_STACK_BYTES}")
  mine = {"LIBTPU_INIT_ARGS": f"{targets.LIBTPU_FIBER_STACK_FLAG}=1048576"}
  targets.use_libtpu_fiber_stack(mine)
  assert mine["LIBTPU_INIT_ARGS"] == f"{targets.LIBTPU_FIBER_STACK_FLAG}=1048576"


@pytest.mark.parametrize("name, kwargs, devices, topology", [
    ("v5e-8", {}, 8, "v5e:2x4"), ("v5litepod-256", {}, 256, "v5e:16x16"),
    ("v4-8", {}, 4, "v4:2x2x1"), ("v5p-128", {}, 64, "v5p:4x4x4"),
    ("v6e-1", {}, 1, "v6e:1x1"), ("v5e-8", {"num_slices": 2}, 16, "v5e:2x4"),
    ("h200", {"num_gpus": 16}, 16, "1x2x8"), ("a100-80gb", {}, 1, "1x1x1")])
def test_target_names_give_their_devices(name, kwargs, devices, topology):
  target = targets.parse(name, **kwargs)
  assert (target.num_devices, target.topology) == (devices, topology)


@pytest.mark.parametrize("name, kwargs, says", [
    ("v5e-6", {}, "power-of-two"), ("tpu-8", {}, "Unknown target"),
    ("h200", {"num_gpus": 12}, "multiple of 8"), ("v5e", {}, "needs a size"),
    ("h100", {"num_slices": 2}, "--num_gpus")])
def test_bad_target_names_say_what_is_known(name, kwargs, says):
  with pytest.raises(targets.TargetError, match=says):
    targets.parse(name, **kwargs)


def test_a_missing_compiler_names_the_extra_to_install(monkeypatch):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  def unavailable(**_):
    raise NotImplementedError("topology not implemented for tpu")
  monkeypatch.setattr(topologies, "get_topology_desc", unavailable)
  monkeypatch.setattr(targets, "_installed", lambda platform: False)
  with pytest.raises(targets.MissingBackendError, match=r"simplified_flax\[tpu\]"):
    targets.topology_devices(targets.parse("v5e-8"))


def _compile_cli(*args):
  proc = subprocess.run([sys.executable, "-m", "simplified_flax.compile", *args],
                        cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                        timeout=300)
  return proc.returncode, proc.stdout, proc.stderr.strip().splitlines()


@pytest.mark.parametrize("target", ["v5e-1", "h100"])
def test_a_step_too_large_for_the_device_is_one_line_and_status_1(target):
  _needs("tpu" if target.startswith("v") else "gpu")
  overrides = [f"--config.{k}={v}" for k, v in TINY.items() if k != "batch_size"]
  # The explicit T x T float32 scores of 4,096 tokens for 256 rows: ~130 GiB of temporaries.
  status, stdout, stderr = _compile_cli(
      "--config=sas_p", f"--target={target}", *overrides, "--config.model.context_length=4096",
      "--config.model.max_position_embeddings=4096", "--config.batch_size=256",
      "--config.model.attention_impl=explicit")
  assert status == 1, stderr
  assert not stdout and len(stderr) == 1
  assert stderr[0].startswith("simplified_flax.compile: error: The step does not fit on "
                              f"{target}: ")
  assert "parallel.fsdp" in stderr[0] and "model.remat" in stderr[0]

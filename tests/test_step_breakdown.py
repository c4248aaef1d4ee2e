"""experiments/step_breakdown.py: the parts' names, and a profiled tiny step on the CPU (the
`--breakdown` flag of the command: test_benchmark.py)."""
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from conftest import TINY_MODEL
from test_loop import REPO

sys.path.insert(0, str(REPO))
from experiments import benchmark  # pylint: disable=wrong-import-position
from simplified_flax.aot import hlo_costs
from experiments import step_breakdown  # pylint: disable=wrong-import-position


@pytest.mark.parametrize("op_name,is_matmul,part", [
    ("jit(train_step)/jvp(Transformer)/wte/jit(_take)/gather", False, "embedding"),
    ("jit(train_step)/jvp(Transformer)/h_3/attn/bqhd,bkhd->bhqk/dot_general", True,
     "attention core"),
    ("jit(train_step)/transpose(jvp(Transformer))/h_0/attn/reduce_sum", False, "attention core"),
    ("jit(train_step)/transpose(jvp(Transformer))/h_0/attn/c_attn/jvp(Transformer)/h_0/attn/"
     "c_attn/dot_general", True, "block matmuls"),
    ("jit(train_step)/jvp(Transformer)/h_1/mlp/c_fc/dot_general", True, "block matmuls"),
    ("jit(train_step)/jvp(Transformer)/h_1/attn/q_norm/mul", False, "norms + other elementwise"),
    ("jit(train_step)/jvp(Transformer)/ln_f/rsqrt", False, "norms + other elementwise"),
    ("jit(train_step)/transpose(jvp(loss))/while/body/closed_call/nd,wd->nw/dot_general", True,
     "head + loss"),
    ("jit(train_step)/optimizer/sqrt", False, "optimizer"),
    ("", False, "other"),
])
def test_parts_follow_the_name_scopes(op_name, is_matmul, part):
  assert step_breakdown.part_of(op_name, is_matmul) == part


@pytest.mark.parametrize("op_name,part", [
    ("jit(s)/transpose(jvp(Transformer))/h_0/h_0/norm1/neg", "norms"),
    ("jit(s)/jvp(Transformer)/h_1/attn/q_norm/mul", "norms"),
    ("jit(s)/transpose(jvp(Transformer))/ln_f/reduce_sum", "norms"),
    ("jit(s)/transpose(jvp(Transformer))/h_2/h_2/mlp/jvp(jit(leaky_relu))/add_any", "activation"),
    ("jit(s)/jvp(Transformer)/h_2/h_2/mlp/c_fc/convert_element_type", "linear operands"),
    ("jit(s)/jvp(Transformer)/h_2/h_2/attn/c_attn/concatenate", "linear operands"),
    ("jit(s)/jvp(Transformer)/h_2/h_2/convert_element_type", "residual + other"),
    ("jit(s)/jvp(Transformer)/h_2/attn/exp", "attention core"),
    ("jit(s)/optimizer/add", "optimizer"),
])
def test_the_bytes_outside_matmuls_split_the_elementwise_part_by_what_it_does(op_name, part):
  assert step_breakdown.non_matmul_part(op_name) == part


@pytest.mark.parametrize("op_name,opcode,part", [
    ("", "slice-start", "copies"), ("", "copy-start", "copies"),
    ("jit(s)/transpose(jvp())/reduce_sum", "all-reduce", "collectives"),
    ("", "all-gather-start", "collectives"), ("", "custom-call", "other"),
    ("jit(s)/jvp(Transformer)/h_1/h_1/norm2/transpose", "copy", "norms"),
])
def test_kernels_of_no_part_are_named_by_their_instruction(op_name, opcode, part):
  assert step_breakdown.non_matmul_part(op_name, opcode) == part


def test_breakdown_of_a_profiled_tiny_step():
  D, L, V, B, T = 32, 2, 500, 2, 16
  config = benchmark.load_config("preln", {
      **{f"model.{k}": v for k, v in TINY_MODEL.items()}, "model.vocab_size": V,
      "model.loss_vocab_chunk_size": 128, "batch_size": B})
  runner = benchmark.Runner("preln", config)
  result = step_breakdown.breakdown(runner.step, runner.run, steps=2)
  parts = result["parts"]
  assert list(parts) == list(step_breakdown.PARTS) and result["timed"]
  tokens = B * T
  # Pre-LN's linear layers: query/key 2D^2, value D^2, output D^2, MLP 8D^2; x3 fwd + bwd.
  assert parts["block matmuls"]["flops"] == 6 * tokens * L * 12 * D * D
  # The tied head: forward and two gradient matmuls (the backward reads the kept logits).
  head_matmuls = 6 * tokens * config.model.n_embd * 4 * 128
  assert head_matmuls <= parts["head + loss"]["flops"] < 1.2 * head_matmuls
  for part in ("attention core", "block matmuls", "head + loss", "optimizer"):
    assert parts[part]["time_s"] > 0 and parts[part]["bytes"] > 0, part
  assert result["op_time_s"] == pytest.approx(sum(p["time_s"] for p in parts.values()))
  text = step_breakdown.table("preln", result, step_time_s=0.01)
  assert "head + loss" in text and "all kernels" in text
  # The same program's roofline split: the bytes outside matmuls by part add up to its own.
  program = hlo_costs.parse(runner.step.as_text())
  split = step_breakdown.roofline_breakdown(program, 1e12, 1e11)["non_matmul_parts"]
  sums = hlo_costs.totals(program)
  assert list(split) == list(step_breakdown.NON_MATMUL_PARTS)
  assert sum(split.values()) == pytest.approx(sums["bytes"] - sums["matmul_bytes"])
  for part in ("norms", "activation", "head + loss", "optimizer"):
    assert split[part] > 0, part
  text = step_breakdown.table("preln", step_breakdown.roofline_breakdown(program, 1e12, 1e11), 0)
  assert f"GB outside matmuls: embedding {split['embedding'] / 1e9:.3f}, " in text


def test_a_loop_counts_once_whether_or_not_its_kernels_show():
  """A loop's event is dropped when its body's kernels have events of their own, and counted
  (as unattributed) when they do not, e.g. kernels replayed from a CUDA graph."""
  def f(x_MK, w_KN):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w_KN), None), x_MK, None, length=3)[0]

  program = hlo_costs.parse(jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile()
                            .as_text())
  loop = next(n for n, i in program.instructions.items() if i.opcode == "while")
  body_kernel = next(n for n, k in program.kernels.items() if k.runs == 3)
  event = lambda name, ns: SimpleNamespace(name=name, duration_ns=ns, stats=[
      ("hlo_op", name), ("hlo_module", program.module)])
  plane = lambda *events: SimpleNamespace(lines=[SimpleNamespace(name="stream", events=events)])
  seconds = step_breakdown._plane_kernel_seconds(  # pylint: disable=protected-access
      plane(event(loop, 900), event(body_kernel, 300)), program)
  assert seconds == {body_kernel: pytest.approx(3e-7)}
  seconds = step_breakdown._plane_kernel_seconds(  # pylint: disable=protected-access
      plane(event(loop, 900)), program)
  assert seconds == {step_breakdown.UNATTRIBUTED: pytest.approx(9e-7)}


def test_a_norms_floor_is_its_input_read_once_and_its_output_written_once():
  """A layer norm compiled on the CPU, where XLA makes several kernels of each way: the floor
  counts what the norm reads from outside once and its largest result once, whatever the
  kernels pass between them."""
  N, D = 64, 256

  def norm(x_ND, scale_D):
    with jax.named_scope("Transformer"), jax.named_scope("h_0"), jax.named_scope("norm1"):
      centred_ND = x_ND - x_ND.mean(-1, keepdims=True)
      return scale_D * centred_ND * jax.lax.rsqrt((centred_ND ** 2).mean(-1, keepdims=True))

  def objective(x_ND, scale_D, dy_ND):
    return jnp.sum(norm(x_ND, scale_D) * dy_ND)

  args = (jnp.ones((N, D)), jnp.ones(D), jnp.ones((N, D)))
  program = hlo_costs.parse(jax.jit(jax.grad(objective, argnums=(0, 1))).lower(*args)
                            .compile().as_text())
  floors = step_breakdown.norm_floors(program)
  array = 4 * N * D
  forward, backward = floors["norm1 forward"], floors["norm1 backward"]
  # Forward: x and the scale read, y written (and a few scalar constants).
  assert 2 * array + 4 * D <= forward["floor"] < 2 * array + 4 * D + 64 < forward["bytes"]
  # Backward: at least dy and what it takes from the forward read, dx written; less than XLA's.
  assert 3 * array <= backward["floor"] < backward["bytes"]
  text = step_breakdown.table("norm", step_breakdown.roofline_breakdown(program, 1e12, 1e11), 0)
  over = sum(f["bytes"] - f["floor"] for f in floors.values())
  assert f"; over the floor {over / 1e9:.3f}" in text and "(one-pass floor): norm1 forward " in text

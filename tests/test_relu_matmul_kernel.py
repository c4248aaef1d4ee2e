"""The MLP's ReLU derivative inside its input-gradient GEMM (`fast/relu_matmul_kernel.py`; the
`relu_matmul` rule of `fast.grad_rules`), run in interpret mode on the CPU: the value and both
gradients are autodiff's of `leaky_relu(h, 0) @ W`, to float32 round-off of the sum's order."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax.fast import grad_rules
from simplified_flax.fast import mlp as fast_mlp
from simplified_flax.fast import plan as plan_lib
from simplified_flax.fast import relu_matmul_kernel
from simplified_flax.model import mlp
from simplified_flax.model import quantize


def _inputs(dtype, B=2, T=96, F=192, D=96):
  """Shapes whose tiles (64 rows, 64 features, 32 of the width) leave a grid of 3 x 3 programs,
  each summing over 3 steps; a quarter of h exactly 0, where the gradient passes."""
  keys = jax.random.split(jax.random.key(0), 3)
  h_BTF = jax.random.normal(keys[0], (B, T, F))
  h_BTF = jnp.where(jnp.arange(F) % 4 == 0, 0.0, h_BTF).astype(dtype)
  kernel_FD = (0.1 * jax.random.normal(keys[1], (F, D))).astype(dtype)
  g_BTD = jax.random.normal(keys[2], (B, T, D)).astype(dtype)
  return h_BTF, kernel_FD, g_BTD


@pytest.mark.parametrize("dtype,rtol,atol", [(jnp.float32, 1e-5, 1e-5),
                                             (jnp.bfloat16, 1e-2, 1e-2)])
def test_the_kernel_gives_autodiffs_value_and_gradients(dtype, rtol, atol):
  h_BTF, kernel_FD, g_BTD = _inputs(dtype)
  assert relu_matmul_kernel.tiles(2 * 96, 192, 96) == (64, 64, 32)
  plain = lambda h, w: jnp.dot(jax.nn.leaky_relu(h, 0.0), w)
  want, want_vjp = jax.vjp(plain, h_BTF, kernel_FD)
  got, got_vjp = jax.vjp(lambda h, w: relu_matmul_kernel.relu_matmul(h, w, True),
                         h_BTF, kernel_FD)
  np.testing.assert_array_equal(got, want)   # the forward is the same product
  (dh_got, dw_got), (dh_want, dw_want) = got_vjp(g_BTD), want_vjp(g_BTD)
  assert dh_got.dtype == dtype and dw_got.dtype == dtype
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(dh_got), f32(dh_want), rtol=rtol, atol=atol)
  np.testing.assert_allclose(f32(dw_got), f32(dw_want), rtol=rtol, atol=atol)
  # Masked exactly where h < 0; at h = 0 the gradient passes (leaky_relu's derivative is 1).
  assert np.all(f32(dh_got)[f32(h_BTF) < 0] == 0)
  zeros = f32(h_BTF) == 0
  np.testing.assert_allclose(f32(dh_got)[zeros], f32(jnp.dot(g_BTD, kernel_FD.T))[zeros],
                             rtol=rtol, atol=atol)


def test_the_kernel_takes_shapes_its_tiles_divide_and_on_a_gpu_half_precision():
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  supported = lambda h, w, interpret=False: relu_matmul_kernel.supported(h, w,
                                                                          interpret=interpret)
  assert supported(spec(128, 128, 3072), spec(3072, 768))     # the paper's shape
  assert relu_matmul_kernel.tiles(128 * 128, 3072, 768) == (128, 128, 64)
  assert not supported(spec(1, 24, 64), spec(64, 32))         # 24 rows: no tile of 16 up
  assert not supported(spec(2, 16, 72), spec(72, 32))         # 4D = 72
  assert not supported(spec(2, 16, 64), spec(64, 40))         # D = 40
  assert not supported(spec(2, 16, 64, dtype=jnp.float32), spec(64, 32, dtype=jnp.float32))
  assert supported(spec(2, 16, 64, dtype=jnp.float32), spec(64, 32, dtype=jnp.float32),
                   interpret=True)
  assert not supported(spec(32, 64), spec(64, 32))            # rows not [B, T]


# "on" on a CPU: every rule, the GPU's kernels interpreted.
EVERY_RULE = plan_lib.Plan("cpu", frozenset(grad_rules.AUTO_PLATFORM), "explicit")


def _mlp_grad_jaxpr(plan, **model_overrides) -> str:
  """The jaxpr of the MLP's gradient: the fast MLP under `plan`, or the reference MLP where
  `plan` is None (the rules "off")."""
  config = tiny_config("preln", **model_overrides)
  mlp_module = (mlp.MLP(config.model) if plan is None
                else fast_mlp.MLP(config.model, plan))
  x_BTD = jnp.ones((2, 16, config.model.n_embd))
  variables = mlp_module.init(jax.random.key(0), x_BTD)
  return str(jax.make_jaxpr(jax.grad(lambda v: mlp_module.apply(v, x_BTD).sum()))(variables))


def test_the_mlp_takes_the_kernel_only_under_the_rule_at_slope_0_without_quantisation():
  assert relu_matmul_kernel.NAME in _mlp_grad_jaxpr(EVERY_RULE)
  assert relu_matmul_kernel.NAME not in _mlp_grad_jaxpr(None)
  without_rule = plan_lib.Plan("cpu", EVERY_RULE.rules - {"relu_matmul"}, "explicit")
  assert relu_matmul_kernel.NAME not in _mlp_grad_jaxpr(without_rule)
  assert relu_matmul_kernel.NAME not in _mlp_grad_jaxpr(EVERY_RULE, lrelu_neg_slope=0.1)
  with quantize.applied("a8"):
    assert relu_matmul_kernel.NAME not in _mlp_grad_jaxpr(EVERY_RULE)
  model_config = tiny_config("preln", grad_rules="auto").model
  auto = lambda platform: plan_lib.choose(model_config, dtype=jnp.bfloat16, platform=platform)
  assert auto("gpu").applies("relu_matmul")
  for platform in ("cpu", "tpu"):
    assert not auto(platform).applies("relu_matmul")

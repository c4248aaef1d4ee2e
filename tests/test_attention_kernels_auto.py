"""`model.attention_impl="auto"`: which path each backend takes, and that the fast model on the
kernel path (a TPU's plan: splash, run in Pallas interpret mode on CPU) gives the explicit
reference form's loss and gradients, while diagnostics still read the attention
probabilities."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from simplified_flax import fast
from simplified_flax.fast import attention_kernels
from simplified_flax.model import transformer

T = attention_kernels.SPLASH_BLOCK   # the splash kernel's smallest sequence


def test_auto_takes_each_backends_fastest_exact_path():
  resolve = attention_kernels.resolve_impl
  assert resolve("auto", dtype=jnp.bfloat16, backend="tpu") == "fused"
  assert resolve("auto", dtype=jnp.float32, backend="tpu") == "fused"
  assert resolve("auto", dtype=jnp.bfloat16, backend="gpu") == "fused"       # cuDNN
  assert resolve("auto", dtype=jnp.float16, backend="gpu") == "fused"
  assert resolve("auto", dtype=jnp.float32, backend="gpu") == "explicit"     # no cuDNN kernel
  assert resolve("auto", dtype=jnp.bfloat16, backend="cpu") == attention_kernels.AUTO_IMPL["cpu"]
  assert resolve("auto", dtype=jnp.bfloat16, backend="tpu", soft_capped=True) == "explicit"
  assert resolve("auto", dtype=jnp.float32, backend="rocm-or-other") == "explicit"
  for asked in ("explicit", "fused"):
    assert resolve(asked, dtype=jnp.float32, backend="tpu") == asked


@pytest.mark.parametrize("variant", ["preln", "sas_p"])
def test_auto_on_the_kernel_path_equals_explicit(variant):
  toks = jax.random.randint(jax.random.key(1), (2, T), 0, 61)
  model_explicit = transformer.build_model(tiny_config(variant, attention_impl="explicit",
                                                  context_length=T).model)
  # "auto" on a TPU: the fused path, its attention the splash kernel (interpreted).
  model_auto = fast.build_model(tiny_config(variant, context_length=T).model, platform="tpu",
                                interpret=True)
  assert isinstance(model_auto, fast.Transformer) and model_auto.plan.attention_impl == "fused"
  assert model_auto.cfg.attention_impl == "auto"   # the default
  variables = model_explicit.init(jax.random.key(0), toks)

  def loss(model, params):
    logits = model.apply({**variables, "params": params}, toks)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]).mean()

  assert "pallas_call" in str(jax.make_jaxpr(functools.partial(loss, model_auto))(
      variables["params"]))
  grad = lambda model: jax.jit(jax.value_and_grad(functools.partial(loss, model)))(
      variables["params"])
  (loss_auto, g_auto), (loss_explicit, g_explicit) = grad(model_auto), grad(model_explicit)
  np.testing.assert_allclose(loss_auto, loss_explicit, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_explicit)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)

  # Collecting intermediates (the diagnostics step) takes the explicit form: A is sown.
  _, state = jax.jit(functools.partial(model_auto.apply, mutable=["intermediates"]))(
      variables, toks)
  assert state["intermediates"]["h_0"]["attn"]["attn_probs"][0].shape == (2, 4, T, T)

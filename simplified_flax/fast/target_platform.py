"""The platform a step is being compiled for: what every path and kernel choice follows.

A choice that depends on the hardware (`model.attention_impl="auto"`, the attention kernel,
`model.grad_rules="auto"`) asks `current()`, never the host's backend: compiling ahead of time
for a TPU or a GPU on a CPU-only machine (`python -m simplified_flax.compile`) must trace the
program that the accelerator runs, splash or cuDNN included. `Placement.compile_step` traces
each step inside `compiling_for(<its devices' platform>)`; outside such a context `current()`
is the platform of JAX's default devices, as before.

    with target_platform.compiling_for("tpu"):
      jax.jit(step).lower(...)      # "auto" resolves as on a TPU
"""
import contextlib
import contextvars
from typing import Iterator, Sequence

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET = contextvars.ContextVar("target_platform", default=None)


def of_devices(devices: Sequence) -> str:
  """The one platform of `devices` ("cpu", "gpu" or "tpu"); CUDA and ROCm devices are "gpu"."""
  platforms = {("gpu" if d.platform in ("cuda", "rocm") else d.platform) for d in devices}
  if len(platforms) != 1:
    raise ValueError(f"A step runs on devices of one platform, not {sorted(platforms)}.")
  return platforms.pop()


def current() -> str:
  """The platform of the step being traced, else of JAX's default devices."""
  return _TARGET.get() or of_devices(jax.devices()[:1])


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
  """Within the context, hardware choices follow `platform` (one of PLATFORMS)."""
  if platform not in PLATFORMS:
    raise ValueError(f"Unknown platform {platform!r}; expected one of {PLATFORMS}.")
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)

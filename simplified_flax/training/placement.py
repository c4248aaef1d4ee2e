"""Where the computation runs: the mesh, shardings, pmap mode, placing batches.

`parallel.mode` "jit": one `jax.jit` over a ("data", "fsdp") mesh; each process hands in its
own rows of the batch; the weights are replicated or, with `parallel.fsdp > 1`, each large leaf
sharded along "fsdp" (ZeRO-3 style). With `parallel.shard_update` the optimiser state is split
over "data" too, and each device updates only its slice of the weights (ZeRO-1 style), whose
new values are then all-gathered. "pmap": `jax.pmap` over the local devices; the state has a
leading device axis, the batch is [devices, rows per device, ...].
"""
import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from simplified_flax.fast import target_platform

DATA, FSDP = "data", "fsdp"
PMAP_AXIS = "batch"
# Leaves smaller than this stay replicated under FSDP: sharding them saves nothing.
MIN_FSDP_SHARD_SIZE = 2 ** 14


def primary_first(fn: Callable[[], Any], name: str) -> Any:
  """`fn()` on process 0, then, after a barrier, on the other processes: set-up that writes
  shared files (a corpus, a tokenizer) is then found ready instead of raced for."""
  if jax.process_count() == 1:
    return fn()
  result = fn() if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices(f"primary_first:{name}")
  return result if jax.process_index() == 0 else fn()


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
  """A (data, fsdp) mesh over `devices` (default: every device of every process)."""
  devices = list(devices if devices is not None else jax.devices())
  if fsdp < 1 or len(devices) % fsdp:
    raise ValueError(f"parallel.fsdp={fsdp} must divide the {len(devices)} devices.")
  return jax.make_mesh((len(devices) // fsdp, fsdp), (DATA, FSDP),
                       axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows split over every device of the mesh (both axes); other dimensions whole."""
  return NamedSharding(mesh, P((DATA, FSDP)))


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """P() (replicated), or "fsdp" on the largest dimension that `fsdp` divides; leaves under
  MIN_FSDP_SHARD_SIZE elements (norm scales, biases, gains) stay replicated."""
  divisible = [d for d in range(len(shape)) if shape[d] % fsdp == 0]
  if fsdp == 1 or not divisible or int(np.prod(shape, dtype=np.int64)) < MIN_FSDP_SHARD_SIZE:
    return P()
  dim = max(divisible, key=lambda d: shape[d])
  return P(*([None] * dim + [FSDP]))


def update_spec(shape: tuple[int, ...], data: int, fsdp: int) -> P:
  """Where a leaf of the weight update lives under `parallel.shard_update`: `fsdp_spec`'s
  dimension (else the largest one) split over ("fsdp", "data"), so that each device's slice
  lies inside its FSDP shard; `fsdp_spec` itself for small leaves and where data * fsdp
  divides no such dimension."""
  base = fsdp_spec(shape, fsdp)
  devices = data * fsdp
  divisible = [d for d in range(len(shape)) if shape[d] % devices == 0]
  if data == 1 or not divisible or int(np.prod(shape, dtype=np.int64)) < MIN_FSDP_SHARD_SIZE:
    return base
  fsdp_dim = next((d for d, axis in enumerate(base) if axis is not None), None)
  if fsdp_dim is not None and fsdp_dim not in divisible:
    return base   # another dimension would move the weights between devices to slice them
  dim = fsdp_dim if fsdp_dim is not None else max(divisible, key=lambda d: shape[d])
  return P(*([None] * dim + [(FSDP, DATA)]))


def shards_update(config) -> bool:
  """`parallel.shard_update` (off where a saved config predates it), in jit mode only."""
  return config.parallel.mode == "jit" and bool(config.parallel.get("shard_update", False))


def state_shardings(abstract_state, mesh: Mesh, shard_update: bool = False):
  """The sharding of every leaf of a (shape-only) train state: `fsdp_spec`, and `update_spec`
  for the optimiser state with `shard_update`."""
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, mesh.shape[FSDP])),
                           abstract_state)
  if not shard_update:
    return shardings
  data, fsdp = mesh.shape[DATA], mesh.shape[FSDP]
  return shardings.replace(opt_state=jax.tree.map(
      lambda x: NamedSharding(mesh, update_spec(x.shape, data, fsdp)), abstract_state.opt_state))


def slices_for_update(grads, params):
  """(grads, params), each leaf constrained to its `update_spec` slice on the mesh the step is
  traced under: the optimiser then reads and writes 1 / (data * fsdp) of its state on each
  device, and the step's output shardings all-gather the new weights. Unchanged off a
  (data > 1) mesh. The gradient is held in its weight's own sharding first: constrained
  straight to the slice, XLA partitions the weight gradients' matmuls in the slice's layout
  instead (a paper-shape v5e-8 step: 1.5x the FLOPs)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names or mesh.shape[DATA] == 1:
    return grads, params
  data, fsdp = mesh.shape[DATA], mesh.shape[FSDP]
  own = jax.tree.map(lambda g: fsdp_spec(g.shape, fsdp), grads)
  update = jax.tree.map(lambda g: update_spec(g.shape, data, fsdp), grads)
  constrain = jax.lax.with_sharding_constraint
  return constrain(constrain(grads, own), update), constrain(params, update)


@dataclasses.dataclass
class Placement:
  """Runs pure `step(state, batch)` functions on the devices in the mode `from_config` chose;
  the loop calls only the methods, never asks which mode it holds. `shard_state`: a single-copy
  state -> the compiled step's; `host_state`: one copy, for checkpointing; `restore_target`:
  every leaf's shape, dtype and sharding as a restore gives them; `place_batch`: this process's
  rows -> the compiled step's; `compile_step(step_fn, abstract, returns_state)`: `step_fn(state,
  batch, axis_name)` as `f(state, batch)`, returning (new_state, outputs) with the old state
  donated when `returns_state`; `host_metrics`: device metrics -> host numpy scalars.
  """
  global_rows: int               # config.batch_size
  mesh: Mesh | None = None       # JitPlacement only
  shard_update: bool = False     # JitPlacement only: parallel.shard_update

  @staticmethod
  def from_config(config, devices=None) -> "Placement":
    """`config.parallel`'s placement over `devices` (default: every device of every process;
    a topology's devices compile ahead of time for hardware this host lacks: jit mode only)."""
    if config.parallel.mode == "jit":
      return JitPlacement(config.batch_size, make_mesh(config.parallel.fsdp, devices),
                          shards_update(config))
    if devices is not None:
      raise ValueError("parallel.mode='pmap' runs on this host's devices only; compile for "
                       "other devices with parallel.mode='jit'.")
    return PmapPlacement(config.batch_size)


class JitPlacement(Placement):
  """One `jax.jit` over the (data, fsdp) mesh (XLA inserts the collectives); the state is
  global arrays throughout."""

  def shard_state(self, state):
    return jax.device_put(state, self.state_shardings(state))

  def host_state(self, state):
    return state   # global arrays: Orbax saves each shard from its process

  def restore_target(self, abstract_state):
    return _with_shardings(abstract_state, self.state_shardings(abstract_state))

  def state_shardings(self, abstract_state):
    return state_shardings(abstract_state, self.mesh, self.shard_update)

  def place_batch(self, local_batch: dict) -> dict:
    """This process's rows [b, ...] -> global arrays [global_rows, ...] sharded by rows."""
    sharding = batch_sharding(self.mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v),
                                                      (self.global_rows,) + np.shape(v)[1:])
            for k, v in local_batch.items()}

  def compile_step(self, step_fn, abstract_state, returns_state=True):
    """The state keeps the shardings of `abstract_state`; outputs are replicated. Traced under
    the mesh, so that TPU splash attention can `shard_map` itself (fast/attention_kernels.py),
    and for the mesh's platform, which the model's hardware choices follow."""
    shardings = self.state_shardings(abstract_state)
    replicated = NamedSharding(self.mesh, P())
    abstract_mesh = self.mesh.abstract_mesh
    platform = target_platform.of_devices(self.mesh.devices.flat)

    def step_under_mesh(state, batch):
      with jax.sharding.use_abstract_mesh(abstract_mesh), target_platform.compiling_for(platform):
        return step_fn(state, batch)

    if not (returns_state and self.shard_update and self.mesh.shape[DATA] > 1):
      return jax.jit(step_under_mesh, in_shardings=(shardings, batch_sharding(self.mesh)),
                     out_shardings=(shardings, replicated) if returns_state else replicated,
                     donate_argnums=(0,) if returns_state else ())
    # The all-gathered new weights go to a buffer of their own: donating the old weights makes
    # XLA copy them in (twice the float32 weights' bytes a step); the old ones are freed when
    # the step returns. The rest of the state is donated.
    def step_keeping_weights(params, rest, batch):
      return step_under_mesh(rest.replace(params=params), batch)
    return _StateSplit(jax.jit(
        step_keeping_weights, donate_argnums=(1,),
        in_shardings=(shardings.params, shardings.replace(params=None), batch_sharding(self.mesh)),
        out_shardings=(shardings, replicated)))

  def host_metrics(self, metrics):
    return jax.device_get(metrics)


@dataclasses.dataclass(frozen=True)
class _StateSplit:
  """`f(state, batch)` (and its `.lower`) for a jitted `g(params, rest_of_state, batch)`."""
  jitted: Any

  def __call__(self, state, batch):
    return self.jitted(state.params, state.replace(params=None), batch)

  def lower(self, state, batch):
    return self.jitted.lower(state.params, state.replace(params=None), batch)


class PmapPlacement(Placement):
  """`jax.pmap` over the local devices, the steps reducing over PMAP_AXIS; every leaf carries
  a leading device axis."""

  def shard_state(self, state):
    n = jax.local_device_count()
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + np.shape(x)), state)

  def host_state(self, state):
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], state)

  def restore_target(self, abstract_state):
    return first_device_target(abstract_state)

  def place_batch(self, local_batch: dict) -> dict:
    """[rows, ...] -> [devices, rows per device, ...] (rows split evenly: config_checks)."""
    n = jax.local_device_count()
    return {k: np.asarray(v).reshape(n, -1, *np.shape(v)[1:]) for k, v in local_batch.items()}

  def compile_step(self, step_fn, abstract_state, returns_state=True):
    del abstract_state   # replicated along the device axis
    return jax.pmap(lambda s, b: step_fn(s, b, axis_name=PMAP_AXIS), axis_name=PMAP_AXIS,
                    donate_argnums=(0,) if returns_state else ())

  def host_metrics(self, metrics):
    """The first replica's (the step averaged them with `lax.pmean`)."""
    return jax.tree.map(lambda x: np.asarray(x)[0], jax.device_get(metrics))


def first_device_target(abstract_state):
  """`abstract_state`'s leaves as ShapeDtypeStructs on this process's first device."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return _with_shardings(abstract_state, jax.tree.map(lambda _: device, abstract_state))


def _with_shardings(abstract_state, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract_state, shardings)

"""A uint32 hash of the bits of every leaf of a pytree, independent of sharding and of the
order of reduction (integer arithmetic wraps exactly): what a checkpoint's `meta` records and
a restore checks (`runs/checkpoints.py`)."""
import jax
import jax.numpy as jnp


def _bits_u32(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  itemsize = jnp.dtype(x.dtype).itemsize
  if itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if itemsize == 2:
    return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if itemsize == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  return jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32), axis=-1)  # 64-bit: add halves


@jax.jit
def fingerprint(tree) -> jax.Array:
  """uint32 hash of all leaves: sum over elements of bits * (2 * flat_index + 1), mixed."""
  total = jnp.uint32(0)
  for leaf in jax.tree.leaves(tree):
    leaf = jnp.asarray(leaf)
    index = jnp.zeros(leaf.shape, jnp.uint32)
    for dim in range(leaf.ndim):
      index = index * jnp.uint32(leaf.shape[dim]) + jax.lax.broadcasted_iota(
          jnp.uint32, leaf.shape, dim)
    leaf_hash = jnp.sum(_bits_u32(leaf) * (2 * index + 1), dtype=jnp.uint32)
    total = total * jnp.uint32(1_000_003) + leaf_hash + jnp.uint32(leaf.size)
  return total



"""Placement pieces that need no extra devices: the FSDP rule, pmap batch layout, the feeder."""
import itertools
import threading

import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import configs
from simplified_flax.data.iterator import CheckpointableIterator
from simplified_flax.data.prefetch import Prefetcher
from simplified_flax.runs import distributed
from simplified_flax.runs.config_checks import ConfigError, validate_run_config
from simplified_flax.training import placement


def test_fsdp_spec_shards_the_largest_divisible_dimension_of_large_leaves():
  big = placement.MIN_FSDP_SHARD_SIZE
  assert placement.fsdp_spec((256, 128), 1) == P()
  assert placement.fsdp_spec((128, 256), 2) == P(None, "fsdp")
  assert placement.fsdp_spec((259, 128), 2) == P(None, "fsdp")   # 259 is odd
  assert placement.fsdp_spec((big * 2,), 4) == P("fsdp")
  assert placement.fsdp_spec((257, 129), 2) == P()                # nothing divides
  assert placement.fsdp_spec((768,), 2) == P()                    # small: replicated


def _config(mode="jit", fsdp=1, batch_size=8):
  return ml_collections.ConfigDict({"batch_size": batch_size,
                                    "parallel": {"mode": mode, "fsdp": fsdp}})


def test_bad_parallel_settings_fail_the_config_check_before_a_placement_is_built():
  def check(overrides, device_count=1):
    validate_run_config(configs.load("preln:cpu", overrides), device_count)
  with pytest.raises(ConfigError, match="parallel.fsdp=2 shards parameters only under"):
    check({"parallel.mode": "pmap", "parallel.fsdp": 2})
  with pytest.raises(ConfigError, match="parallel.mode='spmd'"):
    check({"parallel.mode": "spmd"})
  with pytest.raises(ConfigError, match="batch_size=9 does not split over the 2 devices"):
    check({"parallel.mode": "pmap", "batch_size": 9}, device_count=2)
  with pytest.raises(ConfigError, match="parallel.fsdp=4 must divide the 2 devices"):
    check({"parallel.fsdp": 4}, device_count=2)
  with pytest.raises(ValueError, match="parallel.fsdp=3"):
    placement.make_mesh(3)


def test_pmap_batches_gain_a_device_axis():
  chosen = placement.Placement.from_config(_config("pmap"))
  placed = chosen.place_batch({"inputs": np.zeros((8, 16), np.int32)})
  assert placed["inputs"].shape == (1, 8, 16)      # one local CPU device here
  assert isinstance(chosen, placement.PmapPlacement) and chosen.mesh is None


def test_jit_batches_are_global_arrays():
  chosen = placement.Placement.from_config(_config("jit"))
  placed = chosen.place_batch({"inputs": np.arange(8 * 4).reshape(8, 4)})
  assert placed["inputs"].shape == (8, 4)
  assert isinstance(chosen, placement.JitPlacement) and chosen.mesh is not None
  np.testing.assert_array_equal(placed["inputs"], np.arange(32).reshape(8, 4))


def test_single_process_needs_no_distributed_start(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  assert distributed.initialize_distributed() is False


def _fed(depth):
  """The training loop's feeder over a checkpointable iterator: 5 (batch, state) items, and
  whether a prefetch thread was alive while they were made."""
  others = set(threading.enumerate())   # other tests' iterators may still run theirs
  iterator = CheckpointableIterator(lambda k: ({"x": i} for i in itertools.count(k)), {},
                                    prefetch=0)
  feeder = Prefetcher(((next(iterator), iterator.get_state()) for _ in itertools.count()),
                      transform=lambda item: (item[0]["x"] * 10, item[1]), depth=depth)
  items = [next(feeder) for _ in range(5)]
  threaded = any(t.name == "data-prefetch" for t in set(threading.enumerate()) - others)
  feeder.close()
  return items, threaded


def test_prefetcher_keeps_order_and_tags_with_or_without_a_thread():
  (eager, threaded_eager), (ahead, threaded_ahead) = _fed(0), _fed(2)
  assert not threaded_eager and threaded_ahead   # depth 0 (data.prefetch=0): no thread
  assert [(x, state["batches_drawn"]) for x, state in eager] == [(i * 10, i + 1)
                                                                 for i in range(5)]
  assert eager == ahead


def test_prefetcher_reraises_source_errors_and_stops():
  others = set(threading.enumerate())   # other tests' iterators may still run theirs

  def source():
    yield {"x": 1}, None
    raise RuntimeError("corpus vanished")

  feeder = Prefetcher(source(), depth=1)
  assert next(feeder)[0] == {"x": 1}
  with pytest.raises(RuntimeError, match="corpus vanished"):
    next(feeder)
  feeder.close()
  infinite = Prefetcher((({"x": 0}, None) for _ in iter(int, 1)), depth=1)
  next(infinite)
  infinite.close()
  assert not any(t.name == "data-prefetch" and t.is_alive()
                 for t in set(threading.enumerate()) - others)

"""Joining a multi-process run (`jax.distributed`, gloo on CPU) from flags or the environment,
before any JAX work, and starting `distributed_failure`'s watchdog; without a coordinator
address or `--distributed` the run is single-process.
"""
import os

from absl import flags
from absl import logging
import jax

from simplified_flax.runs import distributed_failure
from simplified_flax.runs import supervisor

# JAX's own verdict on a silent process: the backstop behind distributed_failure's watchdog,
# which ends the survivors sooner and with one line (README, "Errors and exit statuses").
HEARTBEAT_TIMEOUT_S = 25


def define_distributed_flags() -> None:
  """absl flags of `initialize_distributed` (call once, before `app.run`)."""
  flags.DEFINE_string("coordinator_address", None,
                      "host:port of process 0 for a multi-process run "
                      "(env JAX_COORDINATOR_ADDRESS).")
  flags.DEFINE_integer("num_processes", None, "Processes in the run (env JAX_NUM_PROCESSES).")
  flags.DEFINE_integer("process_id", None, "This process's index (env JAX_PROCESS_ID).")
  flags.DEFINE_bool("distributed", False,
                    "Call jax.distributed.initialize() even without the flags above, letting "
                    "JAX detect the cluster (Cloud TPU pods, SLURM, Open MPI).")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           auto: bool = False) -> bool:
  """Joins a multi-process run; returns whether one was joined. Arguments left None fall back
  to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, then (`auto`) to JAX's
  cluster detection."""
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and "JAX_NUM_PROCESSES" in env:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in env:
    process_id = int(env["JAX_PROCESS_ID"])
  if not supervisor.is_multihost(coordinator_address, num_processes, auto, env):
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
  distributed_failure.start_watchdog()
  logging.info("Joined a run of %d processes as process %d (%d local / %d global devices).",
               jax.process_count(), jax.process_index(), jax.local_device_count(),
               jax.device_count())
  return True

"""A multi-process run: joined (`jax.distributed`, gloo on CPU) from flags or the environment
before any JAX work, with `distributed_failure`'s watchdog (neither given: single-process).
The train command runs itself as a watched child (`supervise_if_multihost`, free of JAX) so
that losing process 0 is one line too: JAX ends the others with a C++ report that no Python
callback replaces, and the parent turns it into distributed_failure's line.
"""
import ctypes
import os
import re
import signal
import subprocess
import sys

from absl import flags
from absl import logging

from simplified_flax import cli
from simplified_flax.runs import distributed_failure

# JAX's own verdict on a silent process: the backstop behind distributed_failure's watchdog,
# which ends the survivors sooner and with one line (docs/errors.md).
HEARTBEAT_TIMEOUT_S = 25
_CHILD_ENV = "SIMPLIFIED_FLAX_SUPERVISED"
_FATAL_LINE = re.compile(rb"^F\d{4} \d\d:\d\d:\d\d")   # an absl FATAL record starts the report
_JAX_TERMINATES = b"JAX distributed service detected fatal errors"
_PR_SET_PDEATHSIG = 1


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


def is_multihost(coordinator_address, num_processes, auto: bool, environ) -> bool:
  """Whether these settings (None: unset) join a multi-process run, decided free of JAX."""
  return bool(auto or coordinator_address or num_processes is not None
              or environ.get("JAX_COORDINATOR_ADDRESS") or "JAX_NUM_PROCESSES" in environ)


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           auto: bool = False) -> bool:
  """Joins a multi-process run; returns whether one was joined. Arguments left None fall back
  to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, then (`auto`) to JAX's
  cluster detection."""
  import jax  # pylint: disable=import-outside-toplevel  (supervision runs before JAX)
  env = os.environ   # JAX itself reads JAX_COORDINATOR_ADDRESS
  if num_processes is None and "JAX_NUM_PROCESSES" in env:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in env:
    process_id = int(env["JAX_PROCESS_ID"])
  if not is_multihost(coordinator_address, num_processes, auto, env):
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


def joins_multihost_run(argv, environ) -> bool:
  """Whether these command-line arguments make the command join a multi-process run."""
  auto = (cli.flag_value(argv, "distributed") or "false").lower() in ("true", "1")
  return is_multihost(cli.flag_value(argv, "coordinator_address"),
                      cli.flag_value(argv, "num_processes"), auto, environ)


def supervise_if_multihost(program: str) -> None:
  """In a multi-process run (and not already the child), runs this command as a child (stderr
  relayed, signals passed on, dying with this process) and exits with its outcome; otherwise
  returns at once."""
  if (os.environ.get(_CHILD_ENV) or not sys.platform.startswith("linux")
      or not joins_multihost_run(sys.argv[1:], os.environ)):
    return
  child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], stderr=subprocess.PIPE,
                           env=dict(os.environ, **{_CHILD_ENV: "1"}),
                           preexec_fn=_die_with_parent)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda s, _: child.poll() is None and child.send_signal(s))
  report = _relay_until_fatal(child.stderr)
  status = child.wait()
  if status < 0 and _JAX_TERMINATES in report:
    print(f"{program}: error: {_lost_message(report, sys.argv[1:], os.environ)}",
          file=sys.stderr, flush=True)
    sys.exit(1)
  sys.stderr.buffer.write(report)
  sys.stderr.flush()
  if status < 0:   # end the way the child ended (a signal), for whoever waits on this process
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
  sys.exit(status)


def _die_with_parent() -> None:
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _relay_until_fatal(stderr) -> bytes:
  """Relays `stderr` line by line up to an absl FATAL record; returns the rest (or b"")."""
  held = []
  for line in iter(stderr.readline, b""):
    if held or _FATAL_LINE.match(line):
      held.append(line)
    else:
      sys.stderr.buffer.write(line)
      sys.stderr.flush()
  return b"".join(held)


def _lost_message(report: bytes, argv, environ) -> str:
  """distributed_failure's line for the process JAX's report blames (a task, or the
  coordinator when the service could not be reached)."""
  def setting(flag, env):
    value = cli.flag_value(argv, flag) or environ.get(env) or ""
    return int(value) if value.isdigit() else "?"
  index = setting("process_id", "JAX_PROCESS_ID")
  tasks = sorted({int(t) for t in re.findall(rb"/task:(\d+)", report)} - {index})
  lost = ([f"process {t}" for t in tasks] if tasks else
          ["process 0 (the coordinator)" if b"UNAVAILABLE" in report else "another process"])
  return distributed_failure.message(index, setting("num_processes", "JAX_NUM_PROCESSES"), lost)

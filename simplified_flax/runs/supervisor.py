"""A process of a multi-host run works under a small parent, so that losing process 0 is one
line too.

Process 0 hosts JAX's coordination service. When it dies, JAX's client in every other process
ends that process at once with a C++ report (`F... Terminating process because the JAX
distributed service detected fatal errors`, a stack trace and Python's fault dump); this jaxlib
offers no callback a Python program could put in its place. So the train command, when it
joins a multi-process run, starts itself again as a child and only watches it: stdout is the
child's own, stderr is relayed line by line, SIGTERM and SIGINT are passed on, and the child
gets SIGKILL when the parent dies (Linux), so killing either is killing the process. When the
child ends with that report, the parent prints one line naming the lost process and exits 1;
any other report is relayed unchanged and the child's status is the parent's.
"""
import ctypes
import os
import re
import signal
import subprocess
import sys

from simplified_flax import cli
from simplified_flax.runs import distributed_failure

_CHILD_ENV = "SIMPLIFIED_FLAX_SUPERVISED"
_FATAL_LINE = re.compile(rb"^F\d{4} \d\d:\d\d:\d\d")   # an absl FATAL record starts the report
_JAX_TERMINATES = b"JAX distributed service detected fatal errors"
_PR_SET_PDEATHSIG = 1


def is_multihost(coordinator_address, num_processes, auto: bool, environ) -> bool:
  """The rule by which `distributed.initialize_distributed` joins a multi-process run (kept
  here, free of JAX, because the supervisor decides before JAX is imported)."""
  return bool(auto or coordinator_address or num_processes is not None
              or environ.get("JAX_COORDINATOR_ADDRESS") or "JAX_NUM_PROCESSES" in environ)


def joins_multihost_run(argv, environ) -> bool:
  """Whether these command-line arguments make the command join a multi-process run."""
  auto = (cli.flag_value(argv, "distributed") or "false").lower() in ("true", "1")
  return is_multihost(cli.flag_value(argv, "coordinator_address"),
                      cli.flag_value(argv, "num_processes"), auto, environ)


def supervise_if_multihost(program: str) -> None:
  """In a multi-process run (and not already the child), runs this command as a watched child
  and exits with its outcome; otherwise returns at once."""
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
  """Copies `stderr` to ours line by line until an absl FATAL record; returns that record and
  everything after it (empty if none came)."""
  held = []
  for line in iter(stderr.readline, b""):
    if held or _FATAL_LINE.match(line):
      held.append(line)
    else:
      sys.stderr.buffer.write(line)
      sys.stderr.flush()
  return b"".join(held)


def _lost_message(report: bytes, argv, environ) -> str:
  """distributed_failure's line for the process JAX's report blames: a task it names, or the
  coordinator when the service itself could not be reached."""
  def setting(flag, env):
    value = cli.flag_value(argv, flag) or environ.get(env)
    return int(value) if value is not None and value.isdigit() else None
  index = setting("process_id", "JAX_PROCESS_ID")
  count = setting("num_processes", "JAX_NUM_PROCESSES")
  tasks = sorted({int(t) for t in re.findall(rb"/task:(\d+)", report)} - {index})
  lost = ([f"process {t}" for t in tasks] if tasks else
          ["process 0 (the coordinator)" if b"UNAVAILABLE" in report else "another process"])
  return distributed_failure.message(
      "?" if index is None else index, "?" if count is None else count, lost)

"""The accelerators a step can be compiled for on any machine, and their device facts.

    target = targets.parse("v5e-256")              # or "v5litepod-8", "h200", num_gpus=8, ...
    devices = targets.topology_devices(target)     # libtpu / the CUDA plugin; no accelerator

TPU names count what Google Cloud counts: chips for v5e and v6e (`v5e-8`: 8 chips), cores for
v4 and v5p (`v4-8`: 4 chips of 2 cores, one JAX device each, megacore). `num_slices` > 1 is a
multislice of that many copies. NVIDIA names take `num_gpus`: up to 8 on one host (NVLink),
more as hosts of 8. The devices come from `jax.experimental.topologies`, the same deviceless
compile that maxtext's `train_compile.py` uses: XLA then builds the accelerator's own program
(its kernels, fusions and buffer assignment) here.

DEVICES holds the facts the report divides by: memory per device, the published dense bf16
peak, HBM bandwidth, and for NVIDIA parts the GpuTargetConfig that the CUDA compiler reads.
"""
import dataclasses
import math
import os
from typing import Sequence

# The extras that bring each compiler (pyproject.toml); [cuda12-compile] is the CUDA plugin
# with only the CUDA compiler and cuDNN, without the GPU runtime [cuda12] adds.
TPU_EXTRA, GPU_EXTRA = "tpu", "cuda12-compile"
GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Device:
  """One accelerator model's facts (published figures; leads, not measurements)."""
  kind: str                 # JAX's device_kind
  platform: str             # "tpu" or "gpu"
  memory_bytes: int         # HBM per JAX device
  peak_flops: float         # dense bf16 FLOP/s per JAX device
  hbm_bytes_per_s: float    # HBM bandwidth per JAX device
  cores_per_chip: int = 1   # TPU names that count cores (v4, v5p) divide by this
  max_hosts_chips: int = 4  # TPU chips per host in slices larger than one host
  one_host_chips: int = 4   # TPU slices of at most this many chips sit on one host
  gpu_spec: str = ""        # NVIDIA: the gpu_device_info fields of the GpuTargetConfig


def _gpu_spec(cc_major, cc_minor, sms, clock_ghz, bandwidth, memory, l2, smem_core, smem_optin):
  return (f"cuda_compute_capability {{ major: {cc_major} minor: {cc_minor} }} "
          f"threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
          f"shared_memory_per_block_optin: {smem_optin} shared_memory_per_core: {smem_core} "
          f"threads_per_core_limit: 2048 core_count: {sms} fpus_per_core: 128 "
          f"block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
          f"memory_bandwidth: {int(bandwidth)} l2_cache_size: {l2} clock_rate_ghz: {clock_ghz} "
          f"device_memory_size: {memory} registers_per_core_limit: 65536 "
          f"registers_per_block_limit: 65536")


# Memory sizes are what the runtime reports as usable (TPU v5e: 15.75 GiB of 16).
DEVICES = {
    "v4": Device("TPU v4", "tpu", 32 * GiB, 275e12, 1.2288e12, cores_per_chip=2),
    "v5e": Device("TPU v5 lite", "tpu", int(15.75 * GiB), 197e12, 8.19e11, one_host_chips=8),
    "v5p": Device("TPU v5", "tpu", 95 * GiB, 459e12, 2.765e12, cores_per_chip=2),
    "v6e": Device("TPU v6 lite", "tpu", 31 * GiB + GiB // 4, 918e12, 1.64e12,
                  one_host_chips=8),
    "a100-40gb": Device("NVIDIA A100-SXM4-40GB", "gpu", 40 * 10 ** 9, 312e12, 1.555e12,
                        gpu_spec=_gpu_spec(8, 0, 108, 1.41, 1.555e12, 42_298_834_944,
                                           41_943_040, 167_936, 166_912)),
    "a100-80gb": Device("NVIDIA A100-SXM4-80GB", "gpu", 80 * 10 ** 9, 312e12, 2.039e12,
                        gpu_spec=_gpu_spec(8, 0, 108, 1.41, 2.039e12, 85_089_140_736,
                                           41_943_040, 167_936, 166_912)),
    "h100": Device("NVIDIA H100 80GB HBM3", "gpu", 80 * 10 ** 9, 989e12, 3.35e12,
                   gpu_spec=_gpu_spec(9, 0, 132, 1.98, 3.35e12, 85_028_618_240,
                                      52_428_800, 233_472, 232_448)),
    "h200": Device("NVIDIA H200", "gpu", 141 * 10 ** 9, 989e12, 4.8e12,
                   gpu_spec=_gpu_spec(9, 0, 132, 1.98, 4.8e12, 150_754_820_096,
                                      62_914_560, 233_472, 232_448)),
}
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e", "h100-80gb": "h100", "h200-141gb": "h200"}
TPU_NAMES = "v4-8 ... v4-4096, v5e-1 ... v5e-256 (v5litepod-N), v5p-8 ..., v6e-1 ... v6e-256"
GPU_NAMES = "a100-40gb, a100-80gb, h100, h200 (with --num_gpus)"
GPUS_PER_HOST = 8


def device_of_kind(kind: str) -> Device | None:
  """The table's entry for a JAX `device_kind` (the longest matching name), else None."""
  matches = [d for d in DEVICES.values() if kind == d.kind or kind.startswith(d.kind)]
  return max(matches, key=lambda d: len(d.kind), default=None)


class TargetError(ValueError):
  """A target the table does not have, or a topology it cannot form (a usage error)."""


class DoesNotFitError(RuntimeError):
  """A step needs more memory per device than the target has (one line, exit status 1)."""


class MissingBackendError(RuntimeError):
  """The compiler for the target's platform is not installed (libtpu, the CUDA plugin)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A named slice: `num_devices` JAX devices of `device` (over `num_slices` slices)."""
  name: str                 # as given, e.g. "v5e-256", "h200"
  device: Device
  num_devices: int          # JAX devices in all slices together
  topology: str             # TPU "v5e:16x16"; NVIDIA "1x<hosts>x<gpus per host>"
  num_slices: int = 1
  chips_per_host_bounds: tuple[int, int, int] | None = None

  @property
  def platform(self) -> str:
    return self.device.platform


def parse(name: str, *, num_slices: int = 1, num_gpus: int = 1) -> Target:
  """The target `name` (TPU_NAMES or GPU_NAMES); raises TargetError naming what is known."""
  family, _, count = name.lower().rpartition("-")
  if name.lower() in DEVICES or name.lower() in ALIASES:   # NVIDIA names carry no count
    family, count = name.lower(), ""
  family = ALIASES.get(family, family)
  device = DEVICES.get(family)
  if num_slices < 1 or num_gpus < 1:
    raise TargetError(f"--num_slices={num_slices} and --num_gpus={num_gpus} must be >= 1.")
  if device is None:
    raise TargetError(f"Unknown target {name!r}; known: {TPU_NAMES}; {GPU_NAMES}.")
  if device.platform == "gpu":
    return _gpu_target(name, device, count, num_slices, num_gpus)
  if not count.isdigit():
    raise TargetError(f"Target {name!r} needs a size, e.g. {family}-8; known: {TPU_NAMES}.")
  if num_gpus != 1:
    raise TargetError(f"--num_gpus is for NVIDIA targets; {name} counts its chips in its name.")
  return _tpu_target(name, family, device, int(count), num_slices)


def _gpu_target(name, device, count, num_slices, num_gpus) -> Target:
  if count or num_slices != 1:
    raise TargetError(f"NVIDIA targets take --num_gpus, not a size or --num_slices: "
                      f"--target={name.rsplit('-', 1)[0] if count else name} --num_gpus=N.")
  hosts = max(1, num_gpus // GPUS_PER_HOST)
  if hosts * min(num_gpus, GPUS_PER_HOST) != num_gpus:
    raise TargetError(f"--num_gpus={num_gpus}: up to {GPUS_PER_HOST} on one host, else a "
                      f"multiple of {GPUS_PER_HOST} (hosts of {GPUS_PER_HOST}).")
  return Target(name, device, num_gpus, f"1x{hosts}x{min(num_gpus, GPUS_PER_HOST)}")


def _tpu_target(name, family, device, count, num_slices) -> Target:
  chips, rest = divmod(count, device.cores_per_chip)
  if rest or chips < 1 or chips & (chips - 1):
    unit = "cores (2 per chip)" if device.cores_per_chip == 2 else "chips"
    raise TargetError(f"{name}: the size counts {unit} and must make a power-of-two number "
                      f"of chips; known: {TPU_NAMES}.")
  dims = _grid(chips, 3 if device.cores_per_chip == 2 else 2)
  bounds = None
  if chips <= device.one_host_chips:   # one host holds the whole slice
    bounds = tuple(dims) + (1,) * (3 - len(dims))
  return Target(name, device, chips * num_slices, f"{family}:{'x'.join(map(str, dims))}",
                num_slices=num_slices, chips_per_host_bounds=bounds)


def _grid(chips: int, rank: int) -> list[int]:
  """Power-of-two dims of `rank` whose product is `chips`, as square as possible, ascending
  (v5e-8 -> 2x4, v5e-256 -> 16x16, v4 with 4 chips -> 2x2x1, 64 chips -> 4x4x4)."""
  dims = [1] * rank
  for _ in range(int(math.log2(chips))):
    dims[dims.index(min(dims))] *= 2
  dims = sorted(dims)
  if rank == 3 and dims[0] == 1:   # TPU 3D names put a flat axis last: 2x2x1
    dims = dims[1:] + [1]
  return dims


def topology_devices(target: Target) -> Sequence:
  """The target's JAX devices, for compiling only (nothing runs on them)."""
  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies
  kwargs = {}
  if target.platform == "tpu":
    kwargs = dict(topology_name=target.topology, num_slices=target.num_slices)
    if target.chips_per_host_bounds:
      kwargs["chips_per_host_bounds"] = target.chips_per_host_bounds
    if target.device.cores_per_chip == 2:
      kwargs["chip_config_name"] = "megacore"
    _quiet_libtpu(target)
    use_libtpu_fiber_stack()
    what = "libtpu"
    how = f"'simplified_flax[{TPU_EXTRA}]' (or 'jax[{TPU_EXTRA}]' matching your jax)"
  else:
    kwargs = dict(target_config=gpu_target_config(target.device), topology=target.topology)
    what = "the CUDA plugin of jax (jax-cuda12-plugin)"
    how = f"'simplified_flax[{GPU_EXTRA}]' (the compiler only; [cuda12] to run on the GPU too)"
  platform = "tpu" if target.platform == "tpu" else "cuda"
  try:
    return topologies.get_topology_desc(platform=platform, **kwargs).devices
  except (NotImplementedError, RuntimeError) as error:
    if _installed(target.platform):
      raise TargetError(f"{target.name}: the compiler refused the topology "
                        f"{target.topology}: {str(error).splitlines()[0]}") from None
    raise MissingBackendError(f"Compiling for {target.name} needs {what}: pip install {how}.") \
        from None


def _quiet_libtpu(target: Target) -> None:
  """On a host whose JAX runs on the CPU only, libtpu need not look for a TPU VM's metadata
  (it would print three warnings), and several processes may compile at once (no TPU is
  opened, so its lock file guards nothing); the topology is the one named, either way."""
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name)


# libtpu 0.0.42.1 estimates a fused convolution's cost by recursing through its fused operands
# on a compiler fiber's stack, which is small by default: SAS-P's explicit T x T path at the
# paper's shape (v5e-8), and small explicit steps on one chip, overflow it (SIGSEGV in
# FusedSpatialMajorConvolution::CalculateClassicConvWindowsCost). 16 MiB compiles them (1 MiB
# already did the small one); a tiny step's compile peaks at the same resident memory with 16
# MiB as with 1 MiB (1.09 GB), as the stacks are reserved address space until touched.
LIBTPU_FIBER_STACK_FLAG = "--fibers_default_thread_stack_size"
LIBTPU_FIBER_STACK_BYTES = 16 * 2 ** 20


def use_libtpu_fiber_stack(environ=os.environ) -> None:
  """Adds LIBTPU_FIBER_STACK_FLAG to LIBTPU_INIT_ARGS unless the user set it: libtpu reads it
  when it loads (the first TPU compile or device of the process), so call this before."""
  given = environ.get("LIBTPU_INIT_ARGS", "")
  if LIBTPU_FIBER_STACK_FLAG not in given:
    environ["LIBTPU_INIT_ARGS"] = " ".join(
        filter(None, [given, f"{LIBTPU_FIBER_STACK_FLAG}={LIBTPU_FIBER_STACK_BYTES}"]))


def gpu_target_config(device: Device) -> str:
  """The GpuTargetConfig text (XLA's gpu_specs format) the deviceless CUDA compile reads."""
  return (f"gpu_device_info {{ {device.gpu_spec} }} platform_name: \"CUDA\" "
          f"dnn_version_info {{ major: 9 minor: 8 patch: 0 }} "
          f"runtime_version {{ major: 12 minor: 9 }} device_description_str: \"{device.kind}\"")


def _installed(platform: str) -> bool:
  # pylint: disable=import-outside-toplevel
  import importlib.util
  names = ("libtpu",) if platform == "tpu" else ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")
  return any(_has_module(n, importlib.util) for n in names)


def _has_module(name: str, util) -> bool:
  try:
    return util.find_spec(name) is not None
  except ModuleNotFoundError:
    return False


def prepare_environment() -> None:
  """Before JAX is imported: host work on the CPU (an accelerator host's own chips stay
  free, and libtpu does not probe for a TPU here), and the CUDA plugin loads without a GPU."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def hosts_of(devices: Sequence) -> int:
  return len({d.process_index for d in devices})



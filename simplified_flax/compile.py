"""Compile a config's train and eval steps for an accelerator, on any machine (docs/compile.md,
"Compiling for an accelerator").

    python -m simplified_flax.compile --config=sas_p --target=v5e-8 [--json]
    python -m simplified_flax.compile --config=sas_p --target=v5e-256 --config.parallel.fsdp=8 \\
        --config.batch_size=512
    python -m simplified_flax.compile --config=sas_p --target=h200 [--num_gpus=8]

Needs the target's compiler, not its hardware: `pip install 'simplified_flax[tpu]'` (libtpu)
for TPUs, `'simplified_flax[cuda12-compile]'` for NVIDIA GPUs. Prints the memory per device,
FLOPs, bytes and a roofline bound (estimates read from the compiled program, not timings); `--json`
prints one JSON object instead, `--hlo_out=FILE` writes the train step's optimized HLO. Exit
status 1 with one line when the step does not fit the device's memory, 2 for a bad flag or a
missing compiler. Library use: `aot.programs.compile_for(config, aot.targets.parse(name))`.
"""
from simplified_flax.aot import targets

if __name__ == "__main__":
  targets.prepare_environment()   # before JAX is imported

# pylint: disable=g-import-not-at-top,wrong-import-position
import json

from absl import flags
from etils import epath

from simplified_flax import cli
from simplified_flax.aot import programs
from simplified_flax.aot import report


def main(argv) -> None:
  f = cli.start(argv)
  target = targets.parse(f.target, num_slices=f.num_slices, num_gpus=f.num_gpus)
  compiled = programs.compile_for(f.config, target)
  summary = report.summarize(compiled, compiled.config)
  if f.hlo_out:
    epath.Path(f.hlo_out).write_text(compiled.train.as_text())
  if f.json or summary["fits"]:
    print(json.dumps(summary, indent=1) if f.json else report.text(summary), flush=True)
  if not summary["fits"]:
    m = summary["memory_per_device_bytes"]
    raise programs.DoesNotFitError(programs.does_not_fit_message(
        target, f"it needs {m['total'] / 2 ** 30:.2f} GiB per device (temporaries "
                f"{m['temporaries'] / 2 ** 30:.2f} GiB) and the device has "
                f"{summary['device_memory_bytes'] / 2 ** 30:.2f} GiB"))


if __name__ == "__main__":
  from simplified_flax import config_files
  config_files.define_config_flag()
  flags.DEFINE_string("target", None, f"What to compile for: {targets.TPU_NAMES}; "
                      f"{targets.GPU_NAMES}.", required=True)
  flags.DEFINE_integer("num_slices", 1, "TPU multislice: this many copies of the slice.")
  flags.DEFINE_integer("num_gpus", 1, "NVIDIA targets: GPUs (up to 8 on one host, else hosts "
                       "of 8).")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of the text report.")
  flags.DEFINE_string("hlo_out", None, "Write the train step's optimized HLO to this file.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.compile")

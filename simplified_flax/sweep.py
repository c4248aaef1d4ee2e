"""Sweeps: a grid of config overrides × variants × seeds, each run a train command (docs/sweeps.md).

    python -m simplified_flax.sweep --config=sas_p:cpu --variants=preln,sas_p \\
        --grid=optimizer.learning_rate=1e-3,3e-3 --seeds=2 --workdir_root=DIR [--jobs=2] \\
        [--config.FIELD=VALUE ...] [--reference=preln] [--best_of=optimizer.learning_rate]
        [--extend=2]

A rerun skips finished runs and resumes interrupted ones. `--print` writes one
`python -m simplified_flax.train ...` command per run and runs nothing (for a scheduler);
`--report_only` then writes the report from what finished. With `--best_of`, a best value at
the grid's edge is bracketed first: the next value beyond it is run (up to `--extend` values).
Each run is held to the data's unigram loss: one that did not learn gets no verdict. The
report (`report.md`,
`results.json`, plots) goes to `--output` (default `<workdir_root>/report`).
"""
import shlex
import sys

from absl import flags

from simplified_flax import cli


def main(argv) -> None:
  f = cli.start(argv)
  from simplified_flax.sweeps import driver  # pylint: disable=import-outside-toplevel
  given = sys.argv[1:]
  shared = [a for a in given if a.startswith(("--config.", "--noconfig."))]
  command = shlex.join(["python", "-m", "simplified_flax.sweep"]
                       + [a for a in given if a not in ("--report_only", "--print")])
  sys.exit(driver.sweep(
      config_spec=cli.flag_value(given, "config"), shared=shared, variants=f.variants or [],
      grid=f.grid or [], seeds=f.seeds, workdir_root=f.workdir_root, jobs=f.jobs,
      print_only=f["print"].value, report_only=f.report_only, output=f.output,
      reference=f.reference, best_of=f.best_of, log_dir=f.run_logs, command=command,
      quantize=None if f.quantize == "none" else f.quantize, extend=f.extend))


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag("The config every run starts from: a name or a .py path, "
                                  "then :switches (sas_p:cpu); --variants swaps the name.")
  flags.DEFINE_list("variants", [], "Config names to compare, each with the same switches and "
                    "overrides (default: the --config's own).")
  flags.DEFINE_multi_string("grid", [], "FIELD=v1,v2,... (repeatable; the runs are the product "
                            "of the grids). Values holding commas: separate them by '|'.")
  flags.DEFINE_integer("seeds", 1, "Runs per grid point and variant: seeds config.seed+0..N-1 "
                       "(model init and data order), paired across variants in the report.")
  flags.DEFINE_string("workdir_root", None, "One workdir per run in here (local or gs://).",
                      required=True)
  flags.DEFINE_integer("jobs", 1, "Runs at a time on this host, each on its own GPUs or TPU "
                       "chips where the host has several.")
  flags.DEFINE_bool("print", False, "Print one train command per run and run nothing.")
  flags.DEFINE_bool("report_only", False, "Train nothing: report the runs that finished.")
  flags.DEFINE_string("output", None, "The report's folder (default <workdir_root>/report).")
  flags.DEFINE_string("reference", None, "The variant every other is compared with (default: "
                      "the first of --variants).")
  flags.DEFINE_string("best_of", None, "A --grid field: also compare each variant at its own "
                      "best value of it (lowest mean final eval loss over seeds).")
  flags.DEFINE_integer("extend", 2, "With --best_of over a numeric field: where a variant's "
                       "best value is the grid's smallest or largest, add the next value beyond "
                       "it (the grid's own step) and run it, up to this many values per variant "
                       "(0: never; the report then calls an edge best 'unbracketed').")
  flags.DEFINE_string("run_logs", None, "The runs' logs (default <workdir_root>/logs).")
  from simplified_flax.model import quantize  # pylint: disable=g-import-not-at-top
  flags.DEFINE_enum("quantize", "none", list(quantize.SCHEMES), "Also evaluate each "
                    "finished run's final checkpoint with int8 fake-quantised linear layers "
                    "(python -m simplified_flax.evaluate --quantize); the report shows the loss "
                    "increase.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.sweep")

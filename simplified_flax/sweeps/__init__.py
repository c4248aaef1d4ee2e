"""Sweeps: a grid of config overrides × variants × seeds, each run a `simplified_flax.train`
command in its own workdir, then one report with paired intervals (docs/sweeps.md).

    plan.build(...)      -> the runs, every one checked before any starts
    execute.run_all(...) -> trains the unfinished ones (resuming interrupted ones)
    report.write(...)    -> report.md, results.json and the plots, of comparison.py's
                            numbers (the paired intervals, each variant at its best)

The command line is `python -m simplified_flax.sweep`; experiment scripts call these three.
"""

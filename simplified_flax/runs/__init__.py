"""Run operations around the research loop of `training/`, none of which changes what a step
computes: the config checked before any work (`config_checks`, `data_preflight`), one run per
workdir (`workdir_lock`), multi-process start and the loss of a process (`distributed`,
`distributed_failure`), Orbax checkpoints with their fingerprint (`checkpoints`),
where a (re)started run begins, rewinds included (`resume`), the run's history (`metrics_io`),
the stop asked by SIGTERM or preemption (`checkpoints`) and at a non-finite loss
(`nonfinite`). `training/loop.py` calls them by name.
"""

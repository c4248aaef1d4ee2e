"""Run operations: what keeps a training run safe and resumable around the research loop of
`simplified_flax/training/`, none of which changes what a step computes. The whole config
checked before any work (`config_checks`, `data_preflight`), one run per workdir
(`workdir_lock`), multi-process start and the loss of a process (`distributed`,
`distributed_failure`, `supervisor`), Orbax checkpoints checked by a fingerprint on restore
(`checkpoints`, `fingerprint`), where a (re)started run begins and what a resume with a changed
config does (`resume`, `rewind`, `resume_changes`), the run's history (`metrics_io`), the stop
asked by SIGTERM or a preemption notice (`stop_request`) and the stop at a non-finite loss
(`nonfinite`). `training/loop.py` calls them by name.
"""

"""The one non-finite-loss check of pre-training and fine-tuning: a run stops at the first step
whose loss or gradient norm is NaN or infinite, before it evaluates or saves past it, with an
error naming what to do next (for pre-training: the kept checkpoint steps and the command that
rewinds to one with a lower learning rate; docs/resuming.md, "A way back from divergence").

Bad data is excluded before this advice is given: pre-training batches are made from rows whose
token ids are checked against the vocabulary (`data/shard_checks.py`), so a batch with an id out
of range stops the run with a DataError naming the shard and position before its step runs;
a non-finite loss here therefore comes from in-range ids, and the learning rate is the advice.
"""
import math
from typing import Iterable, Mapping, Sequence


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm of a step was NaN or infinite; the run stopped before saving."""


def check_finite(rows: Iterable[tuple[int, Mapping]], *, label: str = "step",
                 advice: str = "") -> None:
  """Raises NonFiniteLossError at the first (step, metrics) of `rows` whose "loss" or
  "grad_norm" is NaN or infinite; `label` names the kind of step, `advice` ends the message."""
  for step, metrics in rows:
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      raise NonFiniteLossError(f"Non-finite loss at {label} {step} (loss {loss}, grad norm "
                               f"{grad_norm}). {advice}".strip())


def resume_advice(workdir: str, kept_steps: Sequence[int]) -> str:
  """The kept checkpoint steps and the command that rewinds to one with a lower learning rate
  (the one before the last: the last may already carry the blow-up in finite weights), after
  saying that bad token ids are ruled out."""
  kept = sorted(kept_steps)
  ruled_out = ("Every batch's token ids were checked to lie in the vocabulary, so bad ids are "
               "not the cause. ")
  if not kept:
    return ruled_out + (f"No checkpoint is kept in {workdir}: lower "
                        "--config.optimizer.learning_rate and start over with "
                        "--config.restore_step=0.")
  return ruled_out + (
      f"Kept checkpoint steps in {workdir}: {kept}. Rewind to one with a lower learning rate: "
      f"rerun the same train command with --config.restore_step="
      f"{kept[-2] if len(kept) > 1 else kept[-1]} "
      f"--config.optimizer.learning_rate=<lower> (later steps are moved to "
      f"{workdir}/set_aside/, not deleted).")

"""Where a (re)started run begins: `start(...)` finds the state, step, elapsed time and data
position to pick up, from the latest good checkpoint of the workdir or from the one
`config.restore_step` rewinds to (`rewind.py`; the steps after it are set aside only once it
has read back intact), and the console lines that say so: the resumed step and, when the
new config re-shapes the learning-rate schedule, the jump (`resume_changes.py`). Process 0
then cuts the run's history back to that step (`cut_history`), so metrics.jsonl and
TensorBoard read as one uninterrupted run (README, "Resuming").
"""
import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp

from simplified_flax.model.parameters import parameter_shapes
from simplified_flax.runs import checkpoints
from simplified_flax.runs import metrics_io
from simplified_flax.runs import resume_changes
from simplified_flax.runs import rewind


@dataclasses.dataclass(frozen=True)
class Start:
  """Where the loop begins. `state` is the restored train state (in the restore target's
  shardings), None for a fresh run; `notes` are the console lines to print."""
  state: Any = None
  step: int = 0
  elapsed_s: float = 0.0
  data_state: Any = None
  notes: tuple[str, ...] = ()


def start(workdir: str, manager: ocp.CheckpointManager, target_state, config_dict: dict,
          restore_step: int | None) -> Start:
  """The start of a run under `config_dict` with `restore_step` (None: the latest good
  checkpoint, N: rewind to step N, 0: start over). `target_state` gives the shapes, dtypes and
  shardings to restore into. Raises as `rewind.plan` and `checkpoints.restore_latest` do."""
  rewind_to, later_steps = rewind.plan(manager, restore_step)
  restored = None
  if rewind_to != 0:   # 0: start over, so nothing to restore
    restored = checkpoints.restore_latest(manager, target_state, config_dict, parameter_shapes,
                                          workdir, step=rewind_to)
  if rewind_to is not None:   # only once the step to rewind to has read back intact
    rewind.set_aside(workdir, manager, rewind_to, later_steps)
  if restored is None:
    return Start()
  notes = [f"Resuming from the checkpoint of step {restored.step}."]
  schedule_note = resume_changes.schedule_change(restored.config, config_dict, restored.step)
  if schedule_note:
    notes.append(schedule_note)
  return Start(state=restored.state, step=restored.step,
               elapsed_s=float(restored.meta.get("elapsed_s", 0.0)),
               data_state=restored.data_state, notes=tuple(notes))


def cut_history(workdir: str, start_step: int) -> None:
  """Process 0 drops the metrics.jsonl rows and TensorBoard events after `start_step`, written
  by a run that died or was rewound past."""
  if jax.process_index() == 0:
    metrics_io.truncate_history(workdir, start_step)

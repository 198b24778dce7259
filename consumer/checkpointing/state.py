"""What a consumer's checkpoint holds, in one place: the parts that train (model, optimizer, schedule) and
the run's progress (step, samples trained, the epoch of the last step).

Why a shared object: the trainer advances the progress, the checkpointer saves and restores it and the
interval logger reports it; each is handed this state rather than reading another part's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.common.contract.sample_set import SampleSet
from dflash.common.drafter.config import DrafterConfig
from dflash.consumer.schedule import LrSchedule


@dataclass
class TrainProgress:
    """How far the run is: optimizer steps (resumed ones counted), the live set of samples trained (the
    feed skips from it; a save merges every rank's into it) and the campaign epoch of the last step."""

    step: int = 0
    trained: SampleSet = field(default_factory=lambda: SampleSet(epoch=0))
    epoch: int = 0


@dataclass(frozen=True)
class TrainState:
    """The parts a checkpoint saves and a resume restores."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LrSchedule
    drafter_config: DrafterConfig
    progress: TrainProgress

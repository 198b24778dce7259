"""The trainer's drafter: the one DFlash implementation (dflash.common.drafter.dflash, ``DraftMath``)
configured by the project's ``DrafterConfig``. No math lives here: this shell only says where the config
comes from and keeps ``drafter.config`` the ``DrafterConfig`` the rest of the project reads.

Its modules are built from ``config.to_qwen3_config()``, the very config ``dflash-export`` writes, so the
exported folder loads into ``DFlashDraftModel`` (the same code as remote code) with equal state dicts and
equal outputs (tests/test_serving.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import Backend, DraftMath, TargetHead


class DFlashDrafter(DraftMath, nn.Module):
    """N Qwen3-style layers drafting B-token blocks from the target's K-layer context feature.

    ``forward(batch)`` returns the final-normed hidden states of the block tokens [N, B, H]; the loss applies
    the target's lm_head (``draft_loss(out, drafter.target_head.lm_head_weight, ...)``). The target head is
    attached unregistered: ``drafter.to()`` moves it along, keeping its dtype (``DraftMath``).
    """

    def __init__(
        self,
        config: DrafterConfig,
        target_head: TargetHead | None = None,
        *,
        attention_backend: Backend = "auto",
    ):
        nn.Module.__init__(self)
        self.config = config
        self._build_draft(config.to_qwen3_config(), attention_backend)
        self.set_target_head(target_head)
        self.reset_parameters()


def initial_drafter(config: DrafterConfig, head, *, seed: int) -> DFlashDrafter:
    """The drafter a fresh run starts from: weights drawn from `seed` (the consumer's ``--seed`` + rank).

    One function for the trainer and for whoever needs the untrained drafter (the demo's "τ before
    training"), so the two cannot drift apart. Seeding here repeats the trainer's own seeding, with nothing
    random in between, so the weights are those of a fresh launch.
    """
    torch.manual_seed(seed)
    return DFlashDrafter(config, head)

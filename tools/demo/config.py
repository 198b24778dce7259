"""What one ``dflash-demo`` run does (``DemoConfig``, the single source of its flags) and how much of it
(``DemoSize``: the full demo and the CI's quick one). Standard library only: the CLI imports this before
parsing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash.common.cli.flags import flag

PROG = "dflash-demo"


@dataclass(frozen=True, kw_only=True)
class DemoSize:
    """How much the demo does. Sizes measured on a shared 2-core CPU box (README, docs/benchmarks.md)."""

    rows: int | None
    """Rows of the bundled conversations used (None = all 269): the held-out ones are drawn from them."""
    epochs: int
    """Passes over the training rows (dflash-produce --epochs). Measured (docs/benchmarks.md): the drafter's
    held-out τ keeps rising with steps (in-process on the demo's shards: 1.46 at 450, 1.55 at 600, 1.58 at
    900); 12 epochs of the 237 training rows are ~670 steps, 1.42-1.45 through the pipeline, in ~2 min."""
    eval_samples: int
    """Held-out rows (dflash-produce --eval-samples): spooled once, never trained, decoded before/after."""
    eval_every: int
    """Steps between the consumer's decode-order τ evaluations (also before the first and after the last)."""
    num_layers: int = 2
    """Draft layers: 2 learned as much per step as 5 in the demo's few hundred steps, and faster."""
    block_size: int = 8
    """Block 8 learned as much per step as 16 (held-out τ 1.178 vs 1.174 at 150 steps) in half the time:
    a demo's drafter accepts 1-2 tokens, so the last 8 positions of a 16-block only cost."""
    context_tokens: int = 512
    num_anchors: int = 64
    max_anchors_per_doc: int = 16
    save_every: int = 200
    lr: float = 3e-3


FULL = DemoSize(rows=None, epochs=12, eval_samples=32, eval_every=100)


QUICK = DemoSize(rows=None, epochs=2, eval_samples=16, eval_every=1000)


@dataclass(kw_only=True)
class DemoConfig:
    """One demo run (the single source of ``dflash-demo``'s flags)."""

    run_dir: Path = field(metadata=flag(parse=Path, required=False))
    """where logs, metrics and plots go (on the command line, default: runs/demo-YYYYmmdd-HHMMSS)"""
    quick: bool = False
    """the CI variant: fewer rows, epochs and held-out prompts (~1 min)"""
    s3: bool = field(
        default=True,
        metadata=flag(
            name="--local-checkpoints", negate=True, help="checkpoints to a local folder, no S3 server"
        ),
    )
    """Checkpoints to a local moto S3 server (else a local folder)."""
    producers: int = field(default=1, metadata=flag(cli=False))
    consumers: int = field(default=1, metadata=flag(cli=False))
    real_responses: bool = False
    """train on the bundled human-written answers instead of the target's own greedy ones (learns slower;
    the in-training decode-order τ then estimates the real one, and the summary reports the gap)"""
    progress_every_s: float = field(default=5.0, metadata=flag(name="--progress-every", metavar="S"))
    """seconds between progress lines"""
    codec: str | None = None
    """the shards' codec (dflash-produce --codec), e.g. fp8 or bf16 (default: the shard format's default)"""
    seed: int = 0
    """the drafter's seed (dflash-consume --seed): its initialization and anchor draws, and the untrained
    drafter's"""

    @property
    def size(self) -> DemoSize:
        return QUICK if self.quick else FULL

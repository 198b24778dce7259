"""What the producer compiles: the trunk's compile settings on a device (``CompileSpec``) and the batch
shapes to warm before the first batch.

Why apart from the trunk (trunk.py): which shapes a run will see follows from the data's lengths and the
bucket grid alone, so it is planned (and tested) without a model; the trunk only compiles what this says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from dflash.common.cli.flags import check_choices
from dflash.producer.buckets import BucketConfig, Bucketer
from dflash.producer.config import CompileScope, CompileShapes, TrunkCompileConfig

STATIC_BUCKETS_PER_OCTAVE = 4
"""Buckets per doubling of length in the static-shape mode (each one compiled graph)."""
STATIC_MIN_WIDTH = 64
"""Smallest bucket width in the static-shape mode (lengths <= 64 share one shape)."""


@dataclass(frozen=True)
class CompileSpec:
    """How the trunk runs: ``backend`` "eager" (not compiled) or a torch.compile backend (a name, or a
    backend function: tests)."""

    backend: str | Callable = "eager"
    scope: CompileScope = "layers"
    shapes: CompileShapes = "dynamic"
    timeout_s: float | None = None
    """warm-up bound: past it, compiling is abandoned for the eager path (None: no bound)"""

    def __post_init__(self) -> None:
        check_choices(self)

    @property
    def enabled(self) -> bool:
        return self.backend != "eager"

    def describe(self) -> str:
        name = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        return f"compiled ({name}, {self.scope}, {self.shapes} shapes)" if self.enabled else "eager"


def compile_spec(options: TrunkCompileConfig, device: str) -> CompileSpec:
    """The CompileSpec of the compile flags on ``device`` (``--no-compile``; ``--compile-backend`` auto:
    inductor on CUDA, eager on the CPU)."""
    return CompileSpec(
        backend=options.resolved_backend("cuda" if device.startswith("cuda") else "cpu"),
        scope=options.compile_scope,
        shapes=options.compile_shapes,
        timeout_s=options.compile_timeout_s or None,
    )


def static_buckets(cfg: BucketConfig) -> BucketConfig:
    """The bucket grid of the static-shape mode: fixed shapes, coarse (a config already marked
    ``fixed_shapes`` is kept as it is, e.g. a benchmark's own grid)."""
    if cfg.fixed_shapes:
        return cfg
    return replace(
        cfg,
        fixed_shapes=True,
        buckets_per_octave=min(cfg.buckets_per_octave, STATIC_BUCKETS_PER_OCTAVE),
        min_width=max(cfg.min_width, STATIC_MIN_WIDTH),
    )


def shape_buckets(cfg: BucketConfig, spec: CompileSpec) -> BucketConfig:
    """The bucket config the producer batches with under ``spec``."""
    return static_buckets(cfg) if spec.enabled and spec.shapes == "static" else cfg


def warmup_shapes(cfg: BucketConfig, spec: CompileSpec, lengths) -> list[tuple[int, int]]:
    """[rows, length] shapes to compile before producing, for samples of ``lengths`` batched by ``cfg``
    (= `shape_buckets(...)`): static, every bucket shape the data uses; dynamic, full batches of the
    longest and the shortest bucket that hold 2+ rows (a kernel specialized on short lengths, e.g. below one
    64-token chunk of a linear-attention kernel, shows up in warm-up rather than as a recompile), and a
    1-row batch (the size-1 graph), when the data can make one."""
    if not spec.enabled or len(lengths) == 0:
        return []
    bk = Bucketer(cfg)
    buckets = sorted({bk.bucket_of(int(n)) for n in lengths})
    if spec.shapes == "static":
        return [bk.shape_of(b) for b in buckets]
    multi = [b for b in buckets if bk.rows_per_batch(b) >= 2]
    shapes = [bk.shape_of(b) for b in sorted({multi[-1], multi[0]}, reverse=True)] if multi else []
    if len(lengths) > 1 or not multi:  # a partial last batch may hold one row; a lone sample surely does
        shapes.append((1, buckets[0] if multi and buckets[0] != multi[-1] else buckets[-1]))
    return shapes


FLA_NORM_ROWS_PER_CLASS = 65536
"""fla's q/k L2 norm (fla 0.6: ``NB = cdiv(rows, 2048 * 32)``, a compile-time constant) builds one kernel
per class of this many rows, rows = tokens x heads: a new class means a Triton build (~1 s)."""


def mixer_shapes(cfg: BucketConfig, lengths, norm_heads: int = 0) -> list[tuple[int, int]]:
    """[rows, length] inputs that make a linear-attention mixer build the fla kernel variants of a run:
    first a full batch of the longest bucket (fla tunes each kernel at the first shape it sees, and that
    choice is reused at every other token count: common/target/fla_configs.py), then every row count (a
    power of two up to the largest full batch, ``round_rows``: the chunk cumsum specializes on it) at a
    length divisible by 16 or not (64 and 72 tokens), then one row for every class of fla's L2 norm that
    the data's batches can reach with ``norm_heads`` heads (FLA_NORM_ROWS_PER_CLASS; 0: none)."""
    if len(lengths) == 0:
        return []
    bk = Bucketer(cfg)
    buckets = {bk.bucket_of(int(n)) for n in lengths}
    full = max(bk.rows_per_batch(b) for b in buckets)
    shapes = [bk.shape_of(max(buckets))] + [(1 << k, 64) for k in range(full.bit_length())] + [(1, 72)]
    if norm_heads:
        norm_class = lambda tokens: -(-tokens * norm_heads // FLA_NORM_ROWS_PER_CLASS)  # noqa: E731
        most = max(bk.rows_per_batch(b) * b for b in buckets)
        seen = {norm_class(r * n) for r, n in shapes}
        for c in range(1, norm_class(most) + 1):
            if c not in seen:
                shapes.append((1, -(-((c - 1) * FLA_NORM_ROWS_PER_CLASS + 1) // norm_heads)))
    return shapes

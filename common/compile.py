"""torch.compile settings shared by the producer's trunk and the consumer's draft layers, and the one
workaround every compiling process needs.

Standard library only at import: the CLIs build :class:`CompileConfig` from their flags before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash.common.cli.flags import check_choices, flag

CompileBackend = Literal["auto", "inductor", "aot_eager", "eager"]


@dataclass(kw_only=True)
class CompileConfig:
    """Whether and how a process torch.compiles its model (each field is also a command-line flag)."""

    compile: bool = field(
        default=True, metadata=flag(negate=True, help="run eagerly, not compiled (debug, or to compare)")
    )
    """torch.compile the model, warmed once per process"""
    compile_backend: CompileBackend = "auto"
    """torch.compile backend: auto = inductor on CUDA, eager on the CPU (a CPU process is not worth the
    C++ build: the consumer measured the same ms/step at the demo's shapes, and the build costs 33 s to
    minutes on a cold cache); aot_eager traces like inductor without code generation (tests)"""

    def __post_init__(self) -> None:
        check_choices(self)

    def resolved_backend(self, device_type: str) -> str:
        """The backend on ``device_type`` ("cuda" | "cpu"): "eager" (not compiled) when compiling is off,
        and for auto on the CPU."""
        if not self.compile:
            return "eager"
        if self.compile_backend == "auto":
            return "inductor" if device_type == "cuda" else "eager"
        return self.compile_backend


def import_dynamo_in_main_thread() -> None:
    """Import ``torch._dynamo`` now, from the calling (main) thread.

    Why: the first import of torch._dynamo from two threads at once (a writer or checkpoint thread and the
    main thread's first compile) crashes in torch's lazy module setup; importing it once up front, before
    any thread starts, makes every later import a dictionary lookup."""
    import torch._dynamo  # noqa: F401  the import is the point

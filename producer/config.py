"""The producer's configuration: the launch's flags (``LaunchConfig``) and each worker's config
(``ProducerConfig``); together with DataConfig and BucketConfig they are the single source of
``dflash-produce``'s flags (dflash.common.cli.flags). Standard library only: the CLI imports this before
parsing."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.common.cli.flags import flag
from dflash.common.drafter.layers import check_layer_ids
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig

PROG = "dflash-produce"
"""The program name every line of the producer CLI and its supervisor starts with."""


class UsageError(ValueError):
    """A bad flag value or input (reported as one line, exit 2)."""


@dataclass(kw_only=True)
class Worker:
    """One producer process of this launch: its id in the spool, global rank and device."""

    producer_id: str
    rank: int
    device: str
    cuda_index: int | None = None


@dataclass(kw_only=True)
class LaunchConfig:
    """What one ``dflash-produce`` launch runs on, beyond each worker's config."""

    gpus: str = "0"
    """GPUs, one producer each: 0-3 | 0,1 | cpu:N"""
    spool: str | None = None
    """spool directory (default /dev/shm/dflash/<run>)"""
    run: str | None = None
    """run name (checkpoint prefix; default: the spool folder's name)"""
    checkpoint: str | None = None
    """checkpoint store URL (s3://... or a path): skip samples already trained (default: skip none)"""
    block_size: int = 16
    """drafter block size: samples need 2x that many supervised tokens"""
    budget_gb: float | None = None
    """spool budget in GB (default: half the free space)"""
    node_rank: int = 0
    """this node's index (multi-node)"""
    num_nodes: int = 1
    """nodes running producers"""
    progress_s: float = 10.0
    """seconds between progress lines"""
    log_level: str = "INFO"
    """logging level (DEBUG adds tracebacks to errors)"""


@dataclass(kw_only=True)
class ProducerConfig:
    """Everything one producer process needs (the CLI builds one per GPU)."""

    producer_id: str = field(metadata=flag(cli=False))
    """Unique in the spool; appears in shard names ([A-Za-z0-9_.], no '-')."""
    model: str
    """target model path or hub id"""
    spool: str = field(metadata=flag(cli=False))
    """Spool directory."""
    data: DataConfig = field(metadata=flag(cli=False))
    buckets: BucketConfig = field(default_factory=BucketConfig, metadata=flag(cli=False))
    rank: int = field(default=0, metadata=flag(cli=False))
    """Global producer rank (node_rank * producers_per_node + local index)."""
    world: int = field(default=1, metadata=flag(cli=False))
    """Producers over all nodes; this one takes sample indices i with i % world == rank."""
    device: str = field(default="cpu", metadata=flag(cli=False))
    """cpu | cuda | cuda:N."""
    dtype: str = field(default="auto", metadata=flag(choices=("auto", "bfloat16", "float32")))
    """target dtype (auto: bf16 on GPU, fp32 on CPU)"""
    layer_ids: list[int] | None = None
    """target layers to capture, sorted and distinct, e.g. 1,9,17,25,33 (default: K=5 from 1 to L-3)"""
    codec: str | None = None
    """hidden-state codec: none | zstd:<level>[:shuffle] (default: the shard format's default)"""
    budget_bytes: int = field(default=1 << 62, metadata=flag(cli=False))
    """Spool budget: block before writing while the spool holds more bytes than this."""
    skip: bytes | None = field(default=None, metadata=flag(cli=False))
    """SampleSet.to_bytes() of already trained sample ids (from the latest checkpoint)."""
    epochs: int = 1
    """passes over the dataset; recorded in the spool's run record, so consumers and later launches agree"""
    shuffle_seed: int = 0
    """each epoch walks the dataset in an order drawn from (this seed, epoch)"""
    eval_samples: int = 0
    """rows held out for evaluation (drawn by --shuffle-seed, never trained): their hidden states go to
    the spool's eval/ once, and consumers report the decode-order acceptance length on them"""
    run_dir: str | None = None
    """write metrics/producer-<id>.jsonl here (default: no metrics files)"""
    target_name: str | None = field(default=None, metadata=flag(cli=False))
    """Model id recorded in shard metadata (default: `model`)."""
    heartbeat_s: float = field(default=5.0, metadata=flag(cli=False))
    """Seconds between heartbeats (spool state, metrics, the CLI's progress)."""
    writer_threads: int | None = None
    """shard writer threads per producer (default: from the cores per GPU, see writer_threads_for; one
    writer encodes ~1 GB/s of bf16)"""
    compile: bool = field(default=True, metadata=flag(negate=True, help="run the target eagerly (debug, or to compare)"))
    """torch.compile the target trunk (cut after the last captured layer), warmed once per process"""
    compile_backend: str = field(default="auto", metadata=flag(choices=("auto", "inductor", "aot_eager", "eager")))
    """torch.compile backend: auto = inductor on CUDA, eager on the CPU (a CPU producer is not worth the
    C++ build); aot_eager traces like inductor without code generation (tests)"""
    compile_scope: str = field(default="layers", metadata=flag(choices=("layers", "trunk")))
    """layers: each decoder layer compiled, one graph per layer kind (fast to compile, fine with fla's
    graph breaks); trunk: the whole truncated trunk as one graph"""
    compile_shapes: str = field(default="dynamic", metadata=flag(choices=("dynamic", "static")))
    """dynamic: one graph with symbolic rows and length (buckets keep their ~1 % padding); static: one
    graph per bucket shape, batches padded to their bucket's full shape on a coarser grid"""
    compile_timeout_s: float = 240.0
    """seconds the compiled trunk may take to warm up (every batch shape compiled); past it, compiling is
    abandoned for the eager path with one warning line (0: no bound). Measured warm-ups on an H200: 44-82 s
    (docs/producer.md)"""
    chunk_bytes: int = field(default=8 << 20, metadata=flag(cli=False))
    """Bytes per `hidden` chunk in the shards written (larger chunks: less per-chunk overhead)."""
    num_threads: int | None = field(default=None, metadata=flag(cli=False))
    """torch CPU threads (CPU producers share the machine)."""

    def __post_init__(self) -> None:
        if not self.producer_id or "-" in self.producer_id:
            raise ValueError(
                f"ProducerConfig.producer_id={self.producer_id!r}: must be non-empty without '-'"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"ProducerConfig.rank={self.rank}: must be in [0, world={self.world})")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"ProducerConfig.dtype={self.dtype!r}: must be auto, bfloat16 or float32")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"ProducerConfig.device={self.device!r}: must be cpu or cuda[:N]")
        if self.budget_bytes <= 0:
            raise ValueError(f"ProducerConfig.budget_bytes={self.budget_bytes}: must be > 0")
        if self.writer_threads is not None and self.writer_threads < 1:
            raise ValueError(f"ProducerConfig.writer_threads={self.writer_threads}: must be >= 1")
        for name, allowed in (("compile_backend", ("auto", "inductor", "aot_eager", "eager")),
                              ("compile_scope", ("layers", "trunk")), ("compile_shapes", ("dynamic", "static"))):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"ProducerConfig.{name}={getattr(self, name)!r}: must be one of {', '.join(allowed)}")
        if self.compile_timeout_s < 0:
            raise ValueError(f"ProducerConfig.compile_timeout_s={self.compile_timeout_s}: must be >= 0 (0: no bound)")
        if self.chunk_bytes < 1:
            raise ValueError(f"ProducerConfig.chunk_bytes={self.chunk_bytes}: must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError(f"ProducerConfig.heartbeat_s={self.heartbeat_s}: must be > 0")
        if self.epochs < 1:
            raise ValueError(f"ProducerConfig.epochs={self.epochs}: must be >= 1")
        if self.layer_ids is not None:
            self.layer_ids = check_layer_ids(self.layer_ids)

    def resolved_compile_backend(self) -> str:
        """The backend on this device: "eager" (not compiled) with --no-compile, and for auto on the CPU."""
        if not self.compile:
            return "eager"
        if self.compile_backend == "auto":
            return "inductor" if self.device.startswith("cuda") else "eager"
        return self.compile_backend

    def resolved_writer_threads(self) -> int:
        return self.writer_threads if self.writer_threads is not None else writer_threads_for(None)

    def torch_dtype(self):
        """The target's torch dtype (torch is imported here, not at the top: the CLI parses flags first)."""
        import torch  # not at the top: the CLI imports this config before parsing its flags

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


WRITER_CORES = 4
"""Cores per writer thread in the default pool: a writer keeps ~2 busy (its thread + zarr's codec threads)."""
MAX_WRITERS = 6


def writer_threads_for(cores: int | None) -> int:
    """Writer threads for a producer that may use ``cores`` cores (None: 2, the smallest pool).

    The rule (docs/producer.md, "Writers"): one writer encodes ~1.1 GB/s of bf16 (zstd:1:shuffle, 8 MB
    chunks, H200 host); a compiled 8B trunk makes ~42K tok/s x 40 KB = 1.7 GB/s, a 32B-class one ~0.5 GB/s.
    One writer per 4 cores, 2 to 6, gives an H200 node's 16 cores per GPU 4 writers (~4.4 GB/s, 2.6x the
    8B rate: writers are never the limit, so producer / its own forward >= 0.95 holds) and leaves half of
    the GPU's cores to the forward's host thread and the node's consumers.
    """
    if cores is None:
        return 2
    return max(2, min(MAX_WRITERS, cores // WRITER_CORES))

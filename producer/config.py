"""The producer's configuration and each worker's place in its launch.

``ProduceConfig`` is everything ``dflash-produce`` was told: the launch (``LaunchConfig``) and what every
producer does (``ProducerConfig``, composed of DataConfig, BucketConfig and TrunkCompileConfig). Their
fields are the single source of the CLI's flags and defaults (dflash.common.cli.flags). A ``Worker`` is the
runtime state the launch decides per process (id, rank, device, spool, budget, what to skip), kept apart
from the flags. Standard library only: the CLI imports this before parsing."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from dflash.common.cli.flags import check_choices, flag
from dflash.common.compile import CompileConfig
from dflash.common.drafter.layers import check_layer_ids
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig

PROG = "dflash-produce"
"""The program name every line of the producer CLI and its supervisor starts with."""


class UsageError(ValueError):
    """A bad flag value or input (reported as one line, exit 2)."""


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

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"--node-rank {self.node_rank}: must be in [0, --num-nodes {self.num_nodes})")
        if self.spool is None and self.run is None:
            raise ValueError("give --spool DIR or --run NAME (spool then defaults to /dev/shm/dflash/<run>)")

    @property
    def spool_dir(self) -> str:
        return self.spool or f"/dev/shm/dflash/{self.run}"

    @property
    def run_name(self) -> str:
        return self.run or os.path.basename(os.path.normpath(self.spool_dir))


CompileScope = Literal["layers", "trunk"]
CompileShapes = Literal["dynamic", "static"]


@dataclass(kw_only=True)
class TrunkCompileConfig(CompileConfig):
    """How the producer compiles the target trunk: the shared switches plus the trunk's own."""

    compile_scope: CompileScope = "layers"
    """layers: each decoder layer compiled, one graph per layer kind (fast to compile, fine with fla's
    graph breaks); trunk: the whole truncated trunk as one graph"""
    compile_shapes: CompileShapes = "dynamic"
    """dynamic: one graph with symbolic rows and length (buckets keep their ~1 % padding); static: one
    graph per bucket shape, batches padded to their bucket's full shape on a coarser grid"""
    compile_timeout_s: float = 240.0
    """seconds the compiled trunk may take to warm up (every batch shape compiled); past it, compiling is
    abandoned for the eager path with one warning line (0: no bound). Measured warm-ups on an H200: 44-82 s
    (docs/producer.md)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compile_timeout_s < 0:
            raise ValueError(
                f"TrunkCompileConfig.compile_timeout_s={self.compile_timeout_s}: must be >= 0 (0: no bound)"
            )


@dataclass(kw_only=True)
class ProducerConfig:
    """What every producer of a launch does: the target, its data, batching and compiling, the campaign.

    Only choices live here (flags, and a few knobs for library callers); where one producer stands in
    the launch (its id, rank, device, the spool, what to skip) is its :class:`Worker`."""

    model: str
    """target model path or hub id"""
    data: DataConfig = field(metadata=flag(cli=False))
    buckets: BucketConfig = field(default_factory=BucketConfig, metadata=flag(cli=False))
    compile_options: TrunkCompileConfig = field(default_factory=TrunkCompileConfig, metadata=flag(cli=False))
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """target dtype (auto: bf16 on GPU, fp32 on CPU)"""
    target_precision: Literal["auto", "fp8", "bf16"] = "auto"
    """the target's linears: fp8 (e4m3 weights per output channel, quantized at load; activations per row on
    the fly; torch._scaled_mm, Hopper: ~1.8x bf16 matmuls) | bf16 (in --dtype; an FP8 checkpoint
    dequantized) | auto (fp8 for a fine-grained FP8 checkpoint, else --dtype). Captured states stay in --dtype"""
    fp8_fallback: Literal["emulate", "refuse"] = "emulate"
    """where FP8 matmuls do not exist (CPU, GPUs before sm_89): emulate (FP8's numbers by quantize ->
    dequantize, matmuls in --dtype, said in one line) | refuse (exit 2)"""
    layer_ids: list[int] | None = None
    """target layers to capture, sorted and distinct, e.g. 1,9,17,25,33 (default: K=5 from 1 to L-3)"""
    codec: str | None = None
    """hidden-state codec: fp8 (e4m3 + a scale per token and layer, quantized on the GPU: half the bytes) |
    bf16 (exact) | [fp8:]none | [fp8:]zstd:<level> | zstd:<level>:shuffle (default: the shard format's, fp8)"""
    epochs: int = 1
    """passes over the dataset; recorded in the spool's run record, so consumers and later launches agree"""
    shuffle_seed: int = 0
    """each epoch walks the dataset in an order drawn from (this seed, epoch)"""
    eval_samples: int = 0
    """rows held out for evaluation (drawn by --shuffle-seed, never trained): their hidden states go to
    the spool's eval/ once, and consumers report the decode-order acceptance length on them"""
    run_dir: str | None = None
    """write metrics/producer-<id>.jsonl here (default: no metrics files)"""
    writer_threads: int | None = None
    """shard writer threads per producer (default: from the cores per GPU, see writer_threads_for; one
    writer encodes ~1 GB/s of bf16)"""
    target_name: str | None = field(default=None, metadata=flag(cli=False))
    """Model id recorded in shard metadata (default: `model`)."""
    heartbeat_s: float = field(default=5.0, metadata=flag(cli=False))
    """Seconds between heartbeats (spool state, metrics, the CLI's progress)."""
    chunk_bytes: int = field(default=8 << 20, metadata=flag(cli=False))
    """Bytes per `hidden` chunk in the shards written (larger chunks: less per-chunk overhead)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.writer_threads is not None and self.writer_threads < 1:
            raise ValueError(f"ProducerConfig.writer_threads={self.writer_threads}: must be >= 1")
        if self.chunk_bytes < 1:
            raise ValueError(f"ProducerConfig.chunk_bytes={self.chunk_bytes}: must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError(f"ProducerConfig.heartbeat_s={self.heartbeat_s}: must be > 0")
        if self.epochs < 1:
            raise ValueError(f"--epochs {self.epochs}: must be >= 1")
        if self.layer_ids is not None:
            self.layer_ids = check_layer_ids(self.layer_ids)


@dataclass(kw_only=True)
class ProduceConfig:
    """Everything ``dflash-produce`` was told: built once from the flags, the only thing the launch reads."""

    launch: LaunchConfig
    producer: ProducerConfig


@dataclass(kw_only=True)
class Worker:
    """Where one producer process stands in its launch (runtime state the launch decides, not flags)."""

    producer_id: str
    """Unique in the spool; appears in shard names ([A-Za-z0-9_.], no '-')."""
    rank: int = 0
    """Global producer rank (node_rank * producers_per_node + local index)."""
    device: str = "cpu"
    """cpu | cuda | cuda:N (a spawned worker sees its one GPU as cuda:0)."""
    cuda_index: int | None = None
    """The GPU index as the launch sees it (None for a CPU worker)."""
    spool: str = ""
    """Spool directory."""
    world: int = 1
    """Producers over all nodes; this one takes sample indices i with i % world == rank."""
    budget_bytes: int = 1 << 62
    """Spool budget: block before writing while the spool holds more bytes than this."""
    skip: bytes | None = None
    """SampleSet.to_bytes() of already trained sample ids (from the latest checkpoint)."""
    num_threads: int | None = None
    """torch CPU threads (CPU producers share the machine)."""
    writer_threads: int = 2
    """Shard writer threads (ProducerConfig.writer_threads, or sized from this worker's cores)."""

    def __post_init__(self) -> None:
        if not self.producer_id or "-" in self.producer_id:
            raise ValueError(f"Worker.producer_id={self.producer_id!r}: must be non-empty without '-'")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"Worker.rank={self.rank}: must be in [0, world={self.world})")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"Worker.device={self.device!r}: must be cpu or cuda[:N]")
        if self.budget_bytes <= 0:
            raise ValueError(f"Worker.budget_bytes={self.budget_bytes}: must be > 0")
        if self.writer_threads < 1:
            raise ValueError(f"Worker.writer_threads={self.writer_threads}: must be >= 1")

    @property
    def fault_name(self) -> tuple[str, str]:
        """This worker's names in ``DFLASH_FAULT`` (common/fault.py): its id without and with its launch."""
        return self.producer_id.split(".")[0], self.producer_id

    def torch_dtype(self, dtype: str):
        """The target's torch dtype for ``dtype`` (ProducerConfig.dtype) on this device: auto = bf16 on
        CUDA, fp32 on the CPU (torch imported here: the CLI imports this module before parsing)."""
        import torch

        if dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, dtype)


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

"""TODO docstring: split from producer/worker.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dflash.common.target.data import (
    DataConfig,
)
from dflash.producer.buckets import BucketConfig

PROG = "dflash-produce"
"""The program name every line of the producer CLI and its supervisor starts with."""

log = logging.getLogger(__name__)

class UsageError(ValueError):
    """A bad flag value (reported as one line)."""



@dataclass(kw_only=True)
class Worker:
    producer_id: str
    rank: int
    device: str
    cuda_index: int | None = None



@dataclass(kw_only=True)
class ProducerConfig:
    """Everything one producer process needs (the CLI builds one per GPU)."""

    producer_id: str
    """Unique in the spool; appears in shard names ([A-Za-z0-9_.], no '-')."""
    model: str
    """Target model path or hub id (from_pretrained)."""
    spool: str
    """Spool directory."""
    data: DataConfig
    buckets: BucketConfig = field(default_factory=BucketConfig)
    rank: int = 0
    """Global producer rank (node_rank * producers_per_node + local index)."""
    world: int = 1
    """Producers over all nodes; this one takes sample indices i with i % world == rank."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float32."""
    layer_ids: list[int] | None = None
    """Target layers to capture; None: dflash.common.target.layers.default_target_layer_ids(L)."""
    codec: str | None = None
    """Codec spec for the hidden array (None: the shard module's default)."""
    budget_bytes: int = 1 << 62
    """Spool budget: block before writing while the spool holds more bytes than this."""
    skip: bytes | None = None
    """SampleSet.to_bytes() of already trained sample ids (from the latest checkpoint)."""
    epochs: int = 1
    """Passes over the dataset (sample ids: dflash.common.contract.epochs)."""
    shuffle_seed: int = 0
    """Each epoch walks the rows in an order drawn from (shuffle_seed, epoch)."""
    eval_samples: int = 0
    """Rows held out for evaluation (dflash.common.contract.epochs): never trained, spooled once into eval/."""
    run_dir: str | None = None
    """If set, append heartbeat counters to <run_dir>/metrics/producer-<id>.jsonl."""
    target_name: str | None = None
    """Model id recorded in shard metadata (default: `model`)."""
    heartbeat_s: float = 5.0
    writer_threads: int = 2
    """Threads encoding and publishing shards (one encodes ~1 GB/s of bf16: see _Writers)."""
    chunk_bytes: int = 8 << 20
    """Bytes per `hidden` chunk in the shards written (larger chunks: less per-chunk overhead)."""
    num_threads: int | None = None
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
        if self.writer_threads < 1:
            raise ValueError(f"ProducerConfig.writer_threads={self.writer_threads}: must be >= 1")
        if self.chunk_bytes < 1:
            raise ValueError(f"ProducerConfig.chunk_bytes={self.chunk_bytes}: must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError(f"ProducerConfig.heartbeat_s={self.heartbeat_s}: must be > 0")
        if self.epochs < 1:
            raise ValueError(f"ProducerConfig.epochs={self.epochs}: must be >= 1")

    def torch_dtype(self):
        """The target's torch dtype (torch is imported here, not at the top: the CLI parses flags first)."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

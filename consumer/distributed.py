"""The one home of torch.distributed for consumers.

Consumers form one process group through the standard ``env://`` rendezvous (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so ``torchrun`` and ``ops/run_all.sh`` start them the same way. A lone
``dflash-consume`` without those variables is world size 1 and never creates a group: every helper here
is then a no-op, which keeps the single-GPU path free of collective calls.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device, *, timeout_s: float = 1800.0) -> DistInfo:
    """Join the consumer group if the environment names one (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad distributed environment: RANK={rank} WORLD_SIZE={world_size}")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        log.info("joined consumer group: rank %d of %d (%s)", rank, world_size, backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


_control_group: dist.ProcessGroup | None = None


def _control() -> dist.ProcessGroup | None:
    """A gloo group over the same ranks for small host-side agreements (None = the default group).

    With NCCL as the default backend, an all-reduce of host flags would copy them to the GPU and read the
    result back, waiting for every step already queued there: the GPU would drain once per step. Over gloo
    it is a host round trip that never touches the GPU.
    """
    global _control_group
    if dist.get_backend() == "gloo":
        return None
    if _control_group is None:
        _control_group = dist.new_group(backend="gloo")
    return _control_group


def agree_flags(flags: list[bool], info: DistInfo) -> list[int]:
    """For each flag, how many ranks set it (world size 1: the flags as 0/1, no collective)."""
    return sum_ints([int(bool(f)) for f in flags], info)


def sum_ints(values: list[int], info: DistInfo) -> list[int]:
    """Each value summed over ranks, on the host-side control group: no device sync (world size 1: as is)."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_control())
    return [int(x) for x in t.tolist()]


def gather_ints(values: list[int], info: DistInfo) -> list[list[int]]:
    """Every rank's ``values`` (one list per rank, in rank order), on the host-side control group: one
    small collective, and each rank computes sums, minima or maxima from it alike (world size 1: as is)."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if not info.enabled:
        return [t.tolist()]
    out = [torch.zeros_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t, group=_control())
    return [o.tolist() for o in out]


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``t`` over ranks in place (no-op at world size 1)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_bytes(data: bytes, info: DistInfo) -> list[bytes]:
    """Gather one bytes object from every rank (used to merge trained-sample sets at checkpoints)."""
    if not info.enabled:
        return [data]
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, data)
    return [bytes(x) for x in out]  # type: ignore[arg-type]


def all_gather_object(obj: object, info: DistInfo) -> list[object]:
    """Gather one picklable object from every rank (RNG states at checkpoints)."""
    if not info.enabled:
        return [obj]
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, info: DistInfo, src: int = 0) -> object:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def close_distributed() -> None:
    global _control_group
    _control_group = None
    if dist.is_initialized():
        dist.destroy_process_group()

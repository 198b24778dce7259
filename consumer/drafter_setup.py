"""What a consumer process trains on: its device (allocator, threads, the compute dtype) and the drafter
(sized from the target's config, the target's frozen embedding and lm_head, compiled, in DDP when the
group has several ranks). Called once, first thing, by ``Trainer.__init__``.
"""

from __future__ import annotations

import logging
import os

import torch
import zarr
from transformers import AutoConfig, AutoTokenizer

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.layers import SLIDING
from dflash.common.drafter.model import initial_drafter
from dflash.common.target.head import load_target_head
from dflash.consumer import distributed as D
from dflash.consumer.config import TrainConfig
from dflash.consumer.step import cast_parameters, compile_drafter

log = logging.getLogger(__name__)


def maybe_tokenizer(target: str):
    """The target's tokenizer when it ships one: it names the mask token (see choose_mask_token_id)."""
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError):
        return None


def set_up_device(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    """The process's device (named, current) and the compute dtype; the allocator and thread settings."""
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if cfg.expandable_segments and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(
            os.environ
        ):
            # before this process's first CUDA allocation (the CLI and the benches make none before)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        if device.index is None:  # "cuda": the current device, named (streams and DDP want an index)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # tiny fp32 optimizer states turn denormal and crawl otherwise
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
    if cfg.decode_threads:  # the feed's decoder: its chunk-decoding thread pool in this process
        zarr.config.set({"threading.max_workers": cfg.decode_threads})
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def build_drafter(
    cfg: TrainConfig, device: torch.device, compute_dtype: torch.dtype, dist: D.DistInfo
) -> tuple[DrafterConfig, torch.nn.Module, torch.nn.Module]:
    """The drafter's config, the drafter, and the module that trains it (DDP's wrapper with several
    ranks, else the drafter itself)."""
    drafter_config = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(cfg.target),
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids,
        mask_token_id=cfg.mask_token_id,
        tokenizer=maybe_tokenizer(cfg.target),
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
    )
    if SLIDING in drafter_config.layer_types:
        log.info(
            "draft layers %s, sliding window %d", drafter_config.layer_types, drafter_config.sliding_window
        )
    head = load_target_head(cfg.target, dtype=compute_dtype, device=device)
    drafter_config.target_fingerprint = head.fingerprint  # checkpoints and exports carry it
    model = initial_drafter(drafter_config, head, seed=cfg.seed + dist.rank).to(device)
    cast_parameters(model, cfg.param_dtype(device.type))
    if cfg.compile:
        compile_drafter(model, cfg.resolved_compile_backend(device.type))
    train_model: torch.nn.Module = model
    if dist.enabled:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    return drafter_config, model, train_model

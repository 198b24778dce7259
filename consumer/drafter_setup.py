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

from dflash.common.compile import CompileConfig
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.layers import SLIDING
from dflash.common.drafter.model import initial_drafter
from dflash.common.target.head import load_target_head, target_fingerprint
from dflash.consumer import distributed as D
from dflash.consumer.config import DrafterShapeConfig, HostConfig, OptimConfig
from dflash.consumer.step import cast_parameters, compile_drafter

log = logging.getLogger(__name__)


def maybe_tokenizer(target: str):
    """The target's tokenizer when it ships one: it names the mask token (see choose_mask_token_id)."""
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError):
        return None


def set_up_device(device_name: str, host: HostConfig) -> tuple[torch.device, torch.dtype]:
    """The process's device (named, current) and the compute dtype; the allocator and thread settings."""
    if not (device_name == "cpu" or device_name.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device_name!r}")
    device = torch.device(device_name)
    if device.type == "cuda":
        if host.expandable_segments and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(
            os.environ
        ):
            # before this process's first CUDA allocation (the CLI and the benches make none before)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        if device.index is None:  # "cuda": the current device, named (streams and DDP want an index)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # tiny fp32 optimizer states turn denormal and crawl otherwise
        if host.cpu_threads:
            torch.set_num_threads(host.cpu_threads)
    if host.decode_threads:  # the feed's decoder: its chunk-decoding thread pool in this process
        zarr.config.set({"threading.max_workers": host.decode_threads})
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def check_producers_target(record: dict | None, drafter: DrafterConfig, target: str, spool: str) -> None:
    """The drafter is built for what the producers feed it: their target layers and their target (the
    spool's run record: ``model``, ``layer_ids``, ``target_fingerprint``), else ``ValueError`` in one
    line, before step 1. Why: hidden states of another target of the same shape train a drafter that
    never sees its own target's states and a silent nonsense run; another width fails deep in a matmul.
    A record from producers that wrote no fingerprint is compared by the producers' folder when it is
    here to read, else by name (a warning: a hub id and its local copy are the same model)."""
    if not record:
        return
    layers = record.get("layer_ids")
    if layers is not None and [int(i) for i in layers] != list(drafter.target_layer_ids):
        raise ValueError(
            f"--target-layer-ids {','.join(map(str, drafter.target_layer_ids))}: the producers of spool "
            f"{spool} captured target layers {','.join(map(str, layers))} (its run record): give "
            f"--target-layer-ids {','.join(map(str, layers))}"
        )
    model = record.get("model")
    if not model:
        return
    same_path = os.path.realpath(model) == os.path.realpath(target)
    want = record.get("target_fingerprint")
    if want is None and os.path.isdir(model) and not same_path:
        want = target_fingerprint(model)  # producers of an older record: their folder is here to read
    if want is None:
        if not same_path:
            log.warning(
                "--target %s: the producers of spool %s ran %s and recorded no weights fingerprint to "
                "compare: make sure they are the same model",
                target,
                spool,
                model,
            )
        return
    got = target_fingerprint(target)  # from the files, as the producers took theirs (not the loaded dtype)
    if got != want:
        raise ValueError(
            f"--target {target}: not the model the producers of spool {spool} ran ({model}, its run "
            f"record): its embedding/lm_head weights differ (fingerprint {got}, the producers' {want}); "
            "give the producers' --model as --target"
        )


def build_drafter(
    target: str,
    shape: DrafterShapeConfig,
    *,
    seed: int,
    optim: OptimConfig,
    compile_options: CompileConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    dist: D.DistInfo,
) -> tuple[DrafterConfig, torch.nn.Module, torch.nn.Module]:
    """The drafter's config, the drafter (its parameters in the precision's dtype, its layers compiled),
    and the module that trains it (DDP's wrapper with several ranks, else the drafter itself)."""
    drafter_config = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(target),
        num_layers=shape.num_layers,
        block_size=shape.block_size,
        target_layer_ids=shape.target_layer_ids,
        mask_token_id=shape.mask_token_id,
        tokenizer=maybe_tokenizer(target),
        layer_types=shape.layer_types,
        sliding_window=shape.sliding_window,
        arch=shape.drafter_arch,
    )
    if drafter_config.arch == "dflash2" and (
        drafter_config.output_multiplier != 1.0 or drafter_config.final_logit_softcapping is not None
    ):
        raise ValueError(
            f"--drafter-arch dflash2: the target {target} scales its logits (output_multiplier "
            f"{drafter_config.output_multiplier}, final_logit_softcapping {drafter_config.final_logit_softcapping}); "
            "training such a DFlash2 drafter is not supported yet (its loss assumes plain lm_head logits)"
        )
    if drafter_config.arch == "dflash2":
        log.info(
            "drafter: DFlash2 (convolutions k=%d g=%d, selector top-%d rank %d)",
            drafter_config.conv_kernel_size,
            drafter_config.conv_group_size,
            drafter_config.selector_top_k,
            drafter_config.selector_rank,
        )
    if SLIDING in drafter_config.layer_types:
        log.info(
            "draft layers %s, sliding window %d", drafter_config.layer_types, drafter_config.sliding_window
        )
    head = load_target_head(target, dtype=compute_dtype, device=device)
    drafter_config.target_fingerprint = head.fingerprint  # checkpoints and exports carry it
    model = initial_drafter(drafter_config, head, seed=seed + dist.rank).to(device)
    cast_parameters(model, optim.param_dtype(device.type))
    compile_drafter(model, compile_options.resolved_backend(device.type))
    train_model: torch.nn.Module = model
    if dist.enabled:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    return drafter_config, model, train_model

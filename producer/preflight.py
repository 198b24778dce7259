"""TODO docstring: split from producer/cli.py."""

from __future__ import annotations

import logging
import os

from dflash.producer.config import UsageError, Worker

log = logging.getLogger(__name__)


def _check_target(model: str, layer_ids: list[int] | None, max_length: int) -> list[int]:
    """Model config and tokenizer load; the template exists; layer ids fit. Returns the layer ids the
    workers will capture. Raises UsageError."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.common.target.data import DataError, check_tokenizer

    try:
        config = AutoConfig.from_pretrained(model)
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load target {model!r}: {str(err).strip().splitlines()[0]}") from None
    try:
        check_tokenizer(tok, model)
    except DataError as err:
        raise UsageError(str(err)) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    if layer_ids is not None and max(layer_ids) >= num_layers:
        raise UsageError(
            f"--layer-ids {layer_ids}: the target has {num_layers} layers (ids 0..{num_layers - 1})"
        )
    if layer_ids is None:
        from dflash.common.target.layers import default_target_layer_ids

        layer_ids = default_target_layer_ids(num_layers)
    return list(layer_ids)


def _check_gpus(workers: list[Worker], spec: str) -> None:
    """Every CUDA index asked for exists (before anything loads). Raises UsageError."""
    wanted = [w.cuda_index for w in workers if w.cuda_index is not None]
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [i for i in wanted if i >= n]
    if missing:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UsageError(
            f"--gpus {spec}: no CUDA device {missing[0]}: this machine has {n} visible CUDA device(s){where}; "
            "use --gpus cpu:N for a CPU run"
        )


def _check_dataset(data_cfg):
    from dflash.common.target.data import conversation_column, load_raw_dataset

    ds = load_raw_dataset(data_cfg)
    conversation_column(ds, data_cfg.format)
    return ds


def _leftover_samples(spool):
    """Sample indices of the shards still in ready/ and claimed/ (None when there are none)."""
    import numpy as np

    from dflash.common.contract.shard import ShardFormatError, read_sample_index

    parts = []
    for path in spool.leftover_shards():
        try:
            parts.append(read_sample_index(path))
        except FileNotFoundError:
            continue  # acked or moved meanwhile
        except ShardFormatError:
            continue  # a consumer will quarantine it; its samples are re-produced by the next launch
    return np.concatenate(parts) if parts else None

"""Which target layers feed the DFlash drafter, and which of its own layers slide.

Producer and consumer must agree on the layer list (the producer captures exactly these layers and the
drafter's `fc` expects K of them), so the default lives here, in the package both import.
"""

from __future__ import annotations

from typing import Literal

DrafterArch = Literal["dflash", "dflash2"]
"""The drafter architectures (``--drafter-arch``; docs/training.md, "DFlash2"). Here, in the standard-library
module the consumer's CLI config imports, so the choice is written once."""


def default_target_layer_ids(num_target_layers: int, k: int = 5) -> list[int]:
    """K distinct target decoder layers, sorted: the public DFlash rule where it gives K distinct layers.

    The public rule (z-lab/dflash `build_target_layer_ids`, also used by SpecForge) spaces K layers evenly
    from layer 1 to layer L-3 (inclusive): ``round(1 + i * (L - 4) / (k - 1))`` for i in 0..k-1 with Python's
    round-half-to-even, and the middle layer ``L // 2`` when k == 1. Matching it exactly means a drafter
    trained here selects the layers the public inference code derives, e.g. L=36, k=5 -> [1, 9, 17, 25, 33];
    L=52 -> [1, 13, 25, 37, 49]. It gives K distinct layers once L >= K + 3 (every real target).
    Layer i means the output of decoder layer i (HF ``hidden_states[i + 1]``).

    A smaller target would get a repeated layer from the public rule (L=6: [1, 2, 2, 2, 3]): a feature
    captured twice, which only wastes the drafter's input. Instead, K distinct layers spread evenly (rounded
    half up) from layer 1 to the last layer L-1 when L >= K + 1 (L=6 -> [1, 2, 3, 4, 5]; L=7 ->
    [1, 2, 4, 5, 6]); from layer 0 when L == K; and when the target has fewer than K layers, every layer
    (fewer than K ids: the drafter's input is as wide as the list).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if k == 1:
        return [num_target_layers // 2]
    if num_target_layers >= k + 3:
        start, end = 1, num_target_layers - 3
        return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    if num_target_layers < k:
        return list(range(num_target_layers))
    start = 1 if num_target_layers >= k + 1 else 0
    span = num_target_layers - 1 - start  # >= k - 1: consecutive picks differ by >= 1, so all distinct
    return [start + (2 * i * span + k - 1) // (2 * (k - 1)) for i in range(k)]


def check_layer_ids(
    layer_ids: list[int], num_layers: int | None = None, *, what: str = "--layer-ids"
) -> list[int]:
    """The layer ids as ints when they are non-empty, sorted, distinct and (given ``num_layers``) in
    [0, num_layers); else ValueError, one line naming ``what``. Sorted and distinct because the drafter's
    input is the concatenation of the listed layers' features in this order: a repeat only duplicates a
    feature, and one order everywhere (producer, consumer, export, public code) keeps shards comparable."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError(f"{what}: give at least one target layer")
    if ids != sorted(set(ids)):
        raise ValueError(f"{what} {ids}: layer ids must be sorted and distinct, e.g. {sorted(set(ids))}")
    if min(ids) < 0:
        raise ValueError(f"{what} {ids}: layer ids are >= 0")
    if num_layers is not None and max(ids) >= num_layers:
        raise ValueError(f"{what} {ids}: outside 0..{num_layers - 1} (the target has {num_layers} layers)")
    return ids


# ------------------------------------------------------------------------------------ draft layer types
# Standard library only (the consumer's CLI validates --draft-layer-types before importing torch), so these
# two names repeat dflash.common.drafter.dflash's FULL / SLIDING (tests/test_drafter.py keeps them equal).
FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPE_NAMES = {"full": FULL, "sliding": SLIDING, FULL: FULL, SLIDING: SLIDING}

HYBRID_SLIDING_WINDOW = 2048
"""The window of the public DFlash drafter for a hybrid target (z-lab Qwen3.6-27B-DFlash: 4 sliding
layers + 1 full, ``sliding_window`` 2048): the default when a draft layer slides."""


def parse_layer_types(text: str) -> list[str] | None:
    """``--draft-layer-types``: 'auto' -> None; 'sliding,sliding,full' (or the HF names
    sliding_attention / full_attention) -> the HF names; ValueError, one line, on anything else."""
    if text.strip() == "auto":
        return None
    names = [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in LAYER_TYPE_NAMES]
    if bad or not names:
        raise ValueError(f"draft-layer-types: expected 'auto' or a comma list of sliding/full, got {text!r}")
    return [LAYER_TYPE_NAMES[t] for t in names]


def is_hybrid_target(target_config) -> bool:
    """Does the target mix linear attention into its layers (Qwen3.5/3.6 Gated DeltaNet: ``layer_types``
    with ``linear_attention``)? Multimodal configs are read through their text config."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return "linear_attention" in (getattr(cfg, "layer_types", None) or [])


def resolve_layer_types(
    layer_types: list[str] | None, num_layers: int, target_config, sliding_window: int | None
) -> tuple[list[str], int | None]:
    """(layer types, sliding window) of a new drafter. ``layer_types`` None is ``auto``: for a hybrid
    target the public layout, every layer but the last sliding (Qwen3.6-27B-DFlash: 4 + 1), else all full.
    The window defaults to HYBRID_SLIDING_WINDOW when a layer slides; a window with no sliding layer, or a
    list of the wrong length, is a ValueError (one line)."""
    if layer_types is None:
        hybrid = is_hybrid_target(target_config)
        layer_types = (
            [SLIDING] * (num_layers - 1) + [FULL] if hybrid and num_layers > 1 else [FULL] * num_layers
        )
    if len(layer_types) != num_layers:
        raise ValueError(f"draft-layer-types names {len(layer_types)} layers, num-layers is {num_layers}")
    if SLIDING not in layer_types:
        if sliding_window is not None:
            raise ValueError(
                f"sliding-window {sliding_window}: no draft layer slides (layer types {layer_types}); "
                "give --draft-layer-types with sliding layers"
            )
        return list(layer_types), None
    return list(layer_types), HYBRID_SLIDING_WINDOW if sliding_window is None else int(sliding_window)

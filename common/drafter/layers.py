"""Which target layers feed the DFlash drafter.

Producer and consumer must agree on the layer list (the producer captures exactly these layers and the
drafter's `fc` expects K of them), so the default lives here, in the package both import.
"""

from __future__ import annotations


def default_target_layer_ids(num_target_layers: int, k: int = 5) -> list[int]:
    """K target decoder layers spaced evenly from layer 1 to layer L-3 (inclusive), rounded.

    This is the public DFlash rule (z-lab/dflash `build_target_layer_ids`, also used by SpecForge):
    ``round(1 + i * (L - 4) / (k - 1))`` for i in 0..k-1 with Python's round-half-to-even, and the middle
    layer ``L // 2`` when k == 1. Matching it exactly means a drafter trained here selects the same layers
    the public inference code would derive, e.g. L=36, k=5 -> [1, 9, 17, 25, 33]; L=52 -> [1, 13, 25, 37, 49].
    Layer i means the output of decoder layer i (HF ``hidden_states[i + 1]``). For small L the rule can
    repeat a layer; that is kept (it is what the public code does) rather than silently changing the list.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k == 1:
        if num_target_layers < 1:
            raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers must be >= 4 to space {k} layers from 1 to L-3, got {num_target_layers}"
        )
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]

"""Which layers' input hidden states a target returns for its EAGLE-3 draft (low, mid, high).

    capture_layers(61, None) -> (2, 30, 58)      EAGLE-3's choice
    capture_layers(4, None)  -> (0, 2, 3)        shallow: first, middle, last
"""

from __future__ import annotations


def capture_layers(n_layers: int, eagle_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    """``eagle_layers`` if given, else EAGLE-3's (2, L // 2, L - 3). That repeats a layer
    below 7 layers (a draft fed the same state twice loses a third of its input), so shallow
    models take the first, middle and last layer."""
    if eagle_layers is not None:
        return tuple(eagle_layers)
    L = n_layers
    return (2, L // 2, L - 3) if L >= 7 else (0, L // 2, L - 1)


def check_capture_layers(n_layers: int, eagle_layers: tuple[int, ...] | None) -> None:
    """ValueError unless the model has 3 distinct layers to capture, in range."""
    if n_layers < 3:
        raise ValueError(f"n_layers ({n_layers}) must be >= 3: forward() returns the inputs of "
                         "3 distinct layers for the EAGLE-3 draft")
    layers = capture_layers(n_layers, eagle_layers)
    if len(set(layers)) != 3 or len(layers) != 3 or not all(0 <= i < n_layers for i in layers):
        raise ValueError(f"eagle_layers {layers} must be 3 distinct layer indices in "
                         f"[0, {n_layers}); pass eagle_layers=None for the default")

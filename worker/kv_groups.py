"""Hybrid KV cache groups: how a model whose layers attend differently (sliding-window and full
attention: Gemma 3, GPT-OSS) splits its layers into groups, each with its own block table per
request, as vLLM's hybrid KV cache manager does for the TT plugin.

The rule (vLLM v1 `kv_cache_utils`, uniform page size; the plugin's `get_kv_cache_groups` path):
layers of one attention kind (full, or a sliding window W) split into groups of `group_size`
layers, the smallest kind's layer count (the largest's when all are within 1.25x of each other:
fewer, fuller groups). Layer i of every group shares one KV buffer (`tensor_of_layer`), so a
block id holds group_size layers' KV and belongs to one group at a time. Groups are ordered full
attention first: the control plane's group 0 keeps every block of a request (control/blocks.py).

A model with one kind of layer is one group (a model whose every layer slides keeps its whole KV:
nothing to share a pool with, and the window saves no blocks a full group would not).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvGroups:
    windows: tuple[int, ...]             # per group: sliding window in tokens, 0 = full attention
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1

    @property
    def group_size(self) -> int:
        """Layers per block (the largest group: a smaller last group leaves buffers unused)."""
        return max(map(len, self.layers))

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        return self._per_layer(lambda group, position: group)

    @property
    def tensor_of_layer(self) -> tuple[int, ...]:
        """The KV buffer each layer writes: its position within its group."""
        return self._per_layer(lambda group, position: position)

    def _per_layer(self, pick: Callable[[int, int], int]) -> tuple[int, ...]:
        out = {layer: pick(g, i) for g, layers in enumerate(self.layers) for i, layer in enumerate(layers)}
        return tuple(out[layer] for layer in range(len(out)))


def uniform(num_layers: int) -> KvGroups:
    """One full-attention group of every layer."""
    return KvGroups((0,), (tuple(range(num_layers)),))


def group_layers(layer_windows: list[int]) -> KvGroups:
    """The groups of a model whose layer i attends back `layer_windows[i]` tokens (0: all)."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1 or 0 not in kinds:
        return uniform(len(layer_windows))
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    windows, layers = [], []
    for window in sorted(kinds):  # 0 (full attention) first
        members = kinds[window]
        for start in range(0, len(members), size):
            windows.append(window)
            layers.append(tuple(members[start:start + size]))
    return KvGroups(tuple(windows), tuple(layers))

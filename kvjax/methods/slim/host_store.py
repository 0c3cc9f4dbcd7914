"""Host-memory KV store and the overlap-aware swap test (SlimInfer, SlimInfer paper Sec. 4.3,
Algorithm 1).

Blocks of KV (and LazyLLM-style auxiliary hidden states) that are not active live in host
memory: `jax.device_put` to the backend's `pinned_host` memory kind (`unpinned_host` when
that is all it has), or numpy arrays on a backend without host memory kinds. Moving a block
is one `device_put` each way, issued between decode steps; JAX dispatches it
asynchronously, so it overlaps whatever is still running. Every move is counted in bytes.
On CPU the "device" is host memory too: the copies and the byte counts are real, the
bandwidth is not that of a PCIe link.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import jax
import numpy as np

HOST_KINDS = ("pinned_host", "unpinned_host")


def memory_kinds(device=None) -> tuple[str, ...]:
    """The memory kinds a device can address (e.g. ('device', 'pinned_host', ...))."""
    device = device or jax.devices()[0]
    try:
        return tuple(m.kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError):
        return ()


def host_kind(device=None) -> str | None:
    """The host memory kind to offload to, or None (then numpy arrays hold the store)."""
    kinds = memory_kinds(device)
    return next((k for k in HOST_KINDS if k in kinds), None)


def nbytes(tree) -> int:
    leaves = jax.tree.leaves(tree)
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in leaves))


class HostStore:
    """Arrays in host memory under hashable keys, with byte counts of every move.

    `put` moves a (pytree of) device array(s) to host memory; `get` brings it back to the
    device. Both are `device_put`s (asynchronous); a round trip is bit-identical.
    """

    def __init__(self, device=None, kind: str | None = "auto"):
        self.device = device or jax.devices()[0]
        self.kind = host_kind(self.device) if kind == "auto" else kind
        self._host = (jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.kind)
                      if self.kind else None)
        dev_kind = "device" if "device" in memory_kinds(self.device) else None
        self._dev = jax.sharding.SingleDeviceSharding(self.device, memory_kind=dev_kind)
        self.items: dict[Hashable, Any] = {}
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def put(self, key: Hashable, tree) -> int:
        """Offload `tree` under `key` (replacing what was there); returns the bytes moved."""
        if self._host is not None:
            self.items[key] = jax.device_put(tree, self._host)
        else:
            self.items[key] = jax.tree.map(np.asarray, tree)
        b = nbytes(tree)
        self.bytes_to_host += b
        return b

    def get(self, key: Hashable):
        """The stored tree, on the device."""
        tree = self.items[key]
        self.bytes_to_device += nbytes(tree)
        return jax.device_put(tree, self._dev)

    def __contains__(self, key) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def resident_bytes(self, select=lambda key: True) -> int:
        return sum(nbytes(t) for k, t in self.items.items() if select(k))


@dataclasses.dataclass
class SwapDecision:
    """Algorithm 1 for one (stage, element): the new active set and what moves."""

    active: list[int]  # B_active(t), ascending
    swapped: bool
    overlap: float
    load: list[int]  # B_active(t) \ B_active(t-1)
    leave: list[int]  # B_active(t-1) \ B_active(t)
    offload: list[int]  # leave \ B_Memory: must be copied to host before its slot is reused


def overlap_test(active: set[int], candidate: set[int], gamma: float,
                 in_memory: set[int]) -> SwapDecision:
    """Algorithm 1 (overlap-aware KV swapping): keep B_active(t-1) when
    |cand ∩ active| / |cand| >= gamma, else make the candidates active; blocks that leave
    are offloaded unless host memory already holds them, blocks that enter are loaded."""
    overlap = len(candidate & active) / len(candidate) if candidate else 1.0
    if overlap >= gamma:
        return SwapDecision(sorted(active), False, overlap, [], [], [])
    leave = sorted(active - candidate)
    return SwapDecision(sorted(candidate), True, overlap, sorted(candidate - active), leave,
                        [b for b in leave if b not in in_memory])

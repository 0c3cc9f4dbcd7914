"""SlimInfer (block pruning of hidden states in prefill and decode, host offload) and its
baseline LazyLLM: `sliminfer.py` the methods and their hooks, `blocks.py` the schedule and
the block scores (Eq. 1-2), `swap.py` the decode-time re-selection and swapping,
`host_store.py` the host-memory store and Algorithm 1's overlap test."""

from kvjax.methods.slim.sliminfer import (  # noqa: F401
    LazyLLM,
    SlimInfer,
    SlimInferAggressive,
    SlimInferRestrict,
)

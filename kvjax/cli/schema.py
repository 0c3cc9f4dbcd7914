"""A record of `python -m kvjax.run`, typed: what one (method, budget or ratio, task,
context) measured (docs/design.md, "Public contract"). `Record.as_json` is the line written;
readers take the JSON (`kvjax.report.load_records`), and `Weights.of` reads which weights a
record (of any age) was measured on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


@dataclasses.dataclass(frozen=True)
class Weights:
    """The weights a record was measured on (`model_weights`): the checkpoint's sha256 and
    its training steps; None where unknown (records older than the field)."""

    sha256: str | None = None
    trained_steps: int | None = None

    @classmethod
    def of_checkpoint(cls, model_dir: str | None) -> Weights:
        return cls(**_provenance(model_dir))

    @classmethod
    def of(cls, record: dict) -> Weights:
        w = record.get("model_weights") or {}
        return cls(w.get("sha256"), w.get("trained_steps"))

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Record:
    """One record, its fields in the order written. The optional ones (None) are left out:
    `ruler_skip` (only when samples were skipped), `batches` (records before 2026-11-28
    lack it), `kv_fraction_end` (without decoding, or before 2026-11-28), a benchmark file's
    `benchmark`,
    `accuracy_by_dataset` and `predictions`, `note`, and `details` (with --details)."""

    method: str
    budget: int | float | list | None  # a list: a ratio's budgets, one per prompt length
    ratio: float | None
    scenario: str
    task: str
    context_length: int | None
    samples: int
    seed: int
    max_new_tokens: int
    prompt_tokens: dict  # {min, mean, max}
    accuracy: float
    kv_bytes_live: float
    kv_bytes_allocated: float
    kv_bytes_full: float
    kv_fraction: float
    ttft_s: float
    prefill: str  # "shared": the full prefill ran once for the sweep's methods; "own"; "mixed"
    ttft_own_s: float | None  # the method's compression alone, where the prefill was shared
    tpot_s: float | None
    compile_s: float
    method_stats: dict
    kernels: dict
    dtype: str | None
    mesh: dict | None  # {data, model, compression: shard_map | xla}; None: one device
    method_params: dict
    model: str
    model_weights: Weights
    versions: dict
    machine: dict
    job: dict  # the identity --resume matches on
    ruler_skip: int | None = None
    batches: int | None = None  # the batches the samples ran in (ttft_s, tpot_s: their mean)
    # decode steps summed over the batches (each batch's: its longest answer + 1, at most
    # max_new_tokens): tpot_s x steps_run / batches is the decoding's time a batch;
    # None from batches measured before it was recorded
    steps_run: int | None = None
    # the live KV after the last generated token, a share of kv_bytes_full (kv_fraction is
    # after the prefill); None without decoding or from batches measured before it existed
    kv_fraction_end: float | None = None
    benchmark: dict | None = None
    accuracy_by_dataset: dict | None = None
    predictions: list | None = None
    chat_template: bool = False
    note: str | None = None
    details: list | None = None

    _OPTIONAL = ("ruler_skip", "batches", "steps_run", "kv_fraction_end", "benchmark",
                 "accuracy_by_dataset", "predictions", "note", "details")

    def as_json(self) -> dict[str, Any]:
        """The record as written: `ruler_skip` after `seed`, as earlier records hold it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "ruler_skip" or (v is None and f.name in self._OPTIONAL):
                continue  # ruler_skip: written after seed, below
            out[f.name] = v.as_json() if isinstance(v, Weights) else v
            if f.name == "seed" and self.ruler_skip:
                out["ruler_skip"] = self.ruler_skip
        return out


@functools.lru_cache(maxsize=4)
def _provenance(model_dir: str | None) -> dict:
    """A checkpoint's sha256 (a hash of every weight file: once per run, not per record)."""
    from kvjax.models.checkpoint import provenance

    return provenance(model_dir)

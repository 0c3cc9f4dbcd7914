"""The engine: it owns prefill, compression and decoding; methods supply hooks and scores.

- `inputs`: bucketed, left-padded batches and positions;
- `layers`: the layer loops over the prompt and over a cache, calling a method's hooks;
- `token_selection`, `block_pruning`: the prefill loops of methods that change the token
  set between layers (ASL/FastKV/GemFilter; SlimInfer/LazyLLM);
- `steps`: the compiled programs (prefill + compression, a chunk on the cache, the
  decode loop, and the per-step form of it for methods with host work between steps);
- `shared`: one full prefill recorded for every method that compresses after it;
- `driver`: `run`, one generation from token ids to tokens and statistics; `run_each`,
  several (method, rows) runs on one batch sharing its prefill (`run_methods`: several
  methods on all of it).
"""

from kvjax.engine.driver import (  # noqa: F401
    ENGINE_STATS,
    Generation,
    check_method,
    check_request,
    check_tokens,
    run,
    run_each,
    run_methods,
)
from kvjax.engine.executables import clear_compiled, compile_once, compiled_count  # noqa: F401
from kvjax.engine.inputs import bucket, pad_left, positions  # noqa: F401
from kvjax.engine.sampling import Sampling, sample  # noqa: F401
from kvjax.engine.steps import (  # noqa: F401
    compress_prompt,
    decode,
    decode_segment,
    extend,
    prefill,
)

__all__ = ["ENGINE_STATS", "Generation", "Sampling", "bucket", "check_method",
           "check_request", "check_tokens", "clear_compiled", "compile_once", "compiled_count",
           "compress_prompt", "decode", "decode_segment", "extend", "pad_left", "positions",
           "prefill", "run", "run_each", "run_methods", "sample"]

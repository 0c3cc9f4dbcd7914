"""Runs one of RULER's generator scripts (`python ruler_launch.py SCRIPT ARGS...`) with its
tokenizer built outside RULER's seeded random streams (docs/ruler.md, "Reproducible").

Each generator seeds Python's and numpy's global generators, then builds its tokenizer
(`select_tokenizer`), then draws every sample from those generators. Building an HF
tokenizer imports transformers, and what that import pulls in depends on the installed
versions: with huggingface_hub 1.x, httpx imports rich, whose `rich.style` draws
`random.getrandbits(24)` at import. One draw shifts every later one: the same kvjax and
RULER wrote other needles, words and questions on a machine with those versions. Here the
generators' states are saved before the tokenizer is built and restored after, so the
samples are the seed's own wherever they are generated; RULER's scripts run unchanged.

Run as a file, not `-m`: importing kvjax (and jax) for each generator would cost seconds.
"""

import os
import random
import runpy
import sys

import numpy as np


def _outside_the_seeded_streams(select_tokenizer):
    def select(*args, **kwargs):
        py, npy = random.getstate(), np.random.get_state()
        try:
            return select_tokenizer(*args, **kwargs)
        finally:
            random.setstate(py)
            np.random.set_state(npy)
    return select


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    # sys.path as `python SCRIPT` has it (vt imports `constants` from its folder), not this
    # file's folder (kvjax/tasks has a tokenizer.py of its own)
    sys.path[0] = os.path.dirname(script)
    # niah.py imports `long_context_eval.data.tokenizer`, the others `tokenizer` from the
    # data folder (their sys.path.append): two module objects, both patched
    import long_context_eval.data.tokenizer as packaged
    sys.path.append(os.path.dirname(os.path.dirname(script)))  # long_context_eval/data
    import tokenizer as plain
    for module in (packaged, plain):
        module.select_tokenizer = _outside_the_seeded_streams(module.select_tokenizer)
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

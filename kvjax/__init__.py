"""kvjax: KV-cache compression methods on pure-functional Llama/Qwen models in JAX."""

__version__ = "0.1.0"

from kvjax import methods  # noqa: E402
from kvjax.api import Model, Result, compress, generate, load  # noqa: E402
from kvjax.config import ModelConfig  # noqa: E402

__all__ = ["Model", "ModelConfig", "Result", "compress", "generate", "load", "methods", "tasks"]


def __getattr__(name):
    # tasks pull in the tokenizer and word lists: import them only when used
    if name == "tasks":
        import importlib

        return importlib.import_module("kvjax.tasks")
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")

"""kvjax: KV-cache compression methods on pure-functional Llama/Qwen models in JAX."""

__version__ = "0.1.0"

__all__ = ["Model", "ModelConfig", "Result", "compress", "generate", "generate_each", "load",
           "load_tokenizer", "methods", "tasks"]

# Everything is imported on first use: `import kvjax` stays instant, so `python -m kvjax.run`
# reaches its Ctrl-C handling before JAX loads (an interrupt during that import was a
# traceback and a death by SIGINT, not the CLI's one line and exit 130).
_FROM = {"Model": "kvjax.api", "Result": "kvjax.api", "compress": "kvjax.api",
         "generate": "kvjax.api", "generate_each": "kvjax.api", "load": "kvjax.api",
         "load_tokenizer": "kvjax.api", "ModelConfig": "kvjax.config"}


def __getattr__(name):
    import importlib

    if name in ("methods", "tasks"):
        return importlib.import_module(f"kvjax.{name}")
    if name in _FROM:
        # bind every public name at once (the function `compress` lives in kvjax.api; the
        # method protocol's subpackage is `kvjax.compression`, so no import rebinds it)
        for n, mod in _FROM.items():
            globals()[n] = getattr(importlib.import_module(mod), n)
        return globals()[name]
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])

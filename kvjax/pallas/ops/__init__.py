"""One package per kernel op: `api` (the public op), `xla` (the reference) and one module
per Pallas backend (`pallas_tpu`: Mosaic TPU, `pallas_gpu`: Mosaic GPU)."""

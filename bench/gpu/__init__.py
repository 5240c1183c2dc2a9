"""The GPU check (``python -m bench.gpu``): trainer, packing, engine and weight-push numbers on one
CUDA machine in under 10 minutes, or the same sections on small sizes on the CPU (``--device cpu``).
See ``__main__`` for the orchestration, ``report`` for the format, docs/gpu-check.md for the meaning.
"""

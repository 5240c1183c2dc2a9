"""Models built here, for the places that need one without a model hub: ``retool model init-tiny``,
the demo, the benchmarks and the tests (``tiny.py``). No service imports this package: the rollout
and the trainer load whatever Hugging Face directory they are given.
"""

"""Orchestration for one-machine jobs (``retool demo``, ``retool eval``): services started as
local child processes. Above the services in the import order: it may import any of them."""

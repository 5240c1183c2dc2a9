"""The sandbox service's HTTP contract (``/run_code``, sessions, ``/run_jupyter``, ``/healthz``) and
its async client (used by the rollout service)."""

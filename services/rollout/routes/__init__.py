"""The rollout service's HTTP routes, one router module per API (``create_app`` in server.py mounts
them next to ``/healthz``, ``/metrics`` and the lifespan it keeps)."""

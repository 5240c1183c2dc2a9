"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models`` on the rollout service."""

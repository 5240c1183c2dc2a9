"""The reward service's HTTP contract (``/score``, ``/score_batch``) and its async client."""

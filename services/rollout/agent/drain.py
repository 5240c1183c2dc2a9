"""The drain signal shared by the rollout worker and the agent loop.

Invariant: when a replica drains (``AgentLoop.draining`` is set, e.g. on SIGTERM), a sample stops
only at a turn boundary, after its turn checkpoint has been written, by raising ``SampleDrained``;
the worker then hands its job back to the group without publishing it, and another replica
continues the sample from that checkpoint.
"""

from __future__ import annotations


class SampleDrained(Exception):
    """A sample stopped at a turn boundary because its replica drains; its checkpoint holds its state."""

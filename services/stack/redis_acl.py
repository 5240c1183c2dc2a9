"""The Redis ACL of a deployment: who may do what to the two streams.

Invariants (enforced by Redis itself, ``--aclfile``; tests/integration/test_secure_links.py runs
them against a real redis-server):
- ``default`` is off: a connection that does not authenticate can run nothing (not even PING);
- ``trainer`` may add prompt jobs (XADD on the prompts stream) and consume scored groups (read,
  acknowledge, delete, claim on the groups stream) and dead letters; it may XRANGE the prompts
  and groups streams (to find jobs lost with a Redis restart); it cannot add a group;
- ``rollout`` may consume prompt jobs and add groups and dead letters, and keep its turn
  checkpoints (the hashes ``<prompts stream>:ckpt:<job>``: HSET, HGETALL, EXPIRE, DEL; see
  services/rollout/agent/checkpoint.py); it cannot add a prompt job, nor read the groups it wrote
  as a consumer;
- ``health`` may only PING (the container health check);
- both stream users may use only the stream commands the code sends (services/common/queue.py and
  the rollout worker), plus PING, SELECT and MULTI/EXEC (``publish_and_ack``); redis-py's CLIENT
  SETINFO at connect is refused and ignored by the client (Redis < 7.2 has no such command); no
  KEYS, FLUSHALL, CONFIG, DEBUG, EVAL, pub/sub, or other keys;
- passwords appear only as SHA-256 hashes (``#<hex>``).

Key patterns are the stream names followed by ``*`` so one deployment may run several namespaced
pairs (``retool:prompts:2n`` beside ``retool:prompts``, as the deployment test does); dead letters
are ``<prompts stream>:dead``.
"""

from __future__ import annotations

import hashlib

COMMON = "+ping +multi +exec +discard +select"
CONSUME = ("+xreadgroup +xack +xdel +xautoclaim +xclaim +xpending +xgroup|create +xgroup|delconsumer "
           "+xlen +xinfo|groups +xinfo|stream")
OBSERVE = "+xlen +xinfo|groups +xinfo|stream"
CHECKPOINTS = "+hset +hgetall +expire +del"  # the rollout's turn checkpoints, one hash per job


def _hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_file(passwords: dict[str, str], prompts: str = "retool:prompts",
             groups: str = "retool:groups") -> str:
    """The ``users.acl`` text for the ``trainer``, ``rollout`` and ``health`` users."""
    missing = {"trainer", "rollout", "health"} - set(passwords)
    if missing:
        raise ValueError(f"passwords: missing {sorted(missing)}")
    for name in (prompts, groups):
        if any(c.isspace() or c in "()*?[]" for c in name):
            raise ValueError(f"stream name {name!r}: no spaces or glob characters")
    base = "on resetkeys resetchannels -@all"
    lines = [
        "user default off resetkeys resetchannels -@all",
        f"user health {base} {_hash(passwords['health'])} +ping",
        (f"user trainer {base} {_hash(passwords['trainer'])} {COMMON} "
         f"(~{prompts}* +xadd +xrange {OBSERVE}) (~{groups}* {CONSUME} +xrange) "
         f"(~{prompts}*:dead {CONSUME})"),
        (f"user rollout {base} {_hash(passwords['rollout'])} {COMMON} "
         f"(~{prompts}* {CONSUME}) (~{groups}* ~{prompts}*:dead +xadd {OBSERVE}) "
         f"(~{prompts}*:ckpt:* {CHECKPOINTS})"),
    ]
    return "\n".join(lines) + "\n"

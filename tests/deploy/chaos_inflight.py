"""What the chaos test asserts about work in flight when a rollout replica dies or drains (issue 36).

The counters come from the replicas' own ``/metrics`` (read inside their containers): the
continuation side's ``rollout_tokens_regenerated_total``, ``rollout_tokens_resumed_total``,
``rollout_samples_resumed_total`` and ``rollout_samples_restarted_total{reason}``, and the drain
side's ``rollout_worker_jobs{outcome=taken_over|reclaimed}`` and ``rollout_handback_pickup_seconds``.
A faulted replica restarts with its counters at 0, so a fleet's change across a fault is the
restarted replica's values plus the other one's change (``fleet_delta``).

One function per check, each asserting and returning a line for the fault's report:
- ``check_kill_regenerated``: after a SIGKILL mid-generation, the in-flight samples continued
  (resumed from a checkpoint or restarted, counted) and at most one turn per sample was generated
  again; the share of the in-flight tokens regenerated is reported. In-flight tokens at the kill =
  tokens kept from checkpoints (resumed) + tokens lost past them (regenerated);
- ``check_drain_regenerated_nothing``: after a drain (SIGTERM) no token was generated twice;
- ``check_drain_pickup``: every job the drained replica handed back was taken by a replica through
  the hand-back (none waited for a ``claim_idle_ms`` re-claim), each within ``PICKUP_BOUND_S``.
"""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING

from tests.deploy.engine import run

if TYPE_CHECKING:
    from tests.deploy.chaos import Stack

REGENERATED = "rollout_tokens_regenerated_total"
DISCARDED = "rollout_tokens_discarded_total"
RESUMED_TOKENS = "rollout_tokens_resumed_total"
RESUMED_SAMPLES = "rollout_samples_resumed_total"
RESTARTED_SAMPLES = "rollout_samples_restarted_total"
TAKEN_OVER = 'rollout_worker_jobs{outcome="taken_over"}'
RECLAIMED = 'rollout_worker_jobs{outcome="reclaimed"}'
PICKUPS = "rollout_handback_pickup_seconds_count"
PICKUP_SUM = "rollout_handback_pickup_seconds_sum"
PICKUP_BOUND_S = 10.0  # a histogram bucket bound, below the chaos stack's claim_idle_ms (15 s)
PICKUPS_IN_BOUND = f'rollout_handback_pickup_seconds_bucket{{le="{PICKUP_BOUND_S}"}}'
COUNTERS = (REGENERATED, DISCARDED, RESUMED_TOKENS, RESUMED_SAMPLES, RESTARTED_SAMPLES, TAKEN_OVER, RECLAIMED,
            PICKUPS, PICKUP_SUM, PICKUPS_IN_BOUND)

# sums each name's series (a name with labels: that series only); absent metrics read 0
COUNTERS_PROBE = """
import json, urllib.request
names = {names!r}
text = urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=10).read().decode()
out = dict.fromkeys(names, 0.0)
for line in text.splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    series, value = line.rsplit(" ", 1)
    for n in names:
        if series == n or ("{{" not in n and series.startswith(n + "{{")):
            out[n] += float(value)
print(json.dumps(out))
"""


def rollout_counters(s: Stack, index: int) -> dict[str, float]:
    """The COUNTERS of rollout replica ``index``, from its own /metrics."""
    got = s.c.json_from("rollout-cpu", COUNTERS_PROBE.format(names=list(COUNTERS)), index=index, timeout=60)
    return {k: float(v) for k, v in got.items()}  # type: ignore[union-attr]


def fleet_delta(s: Stack, restarted: int, other: int, other_before: dict[str, float]) -> dict[str, float]:
    """The fleet's change across a fault that restarted replica ``restarted`` (its counters began at 0)."""
    now_restarted, now_other = rollout_counters(s, restarted), rollout_counters(s, other)
    return {k: now_restarted[k] + now_other[k] - other_before[k] for k in COUNTERS}


def checkpointed_job_held(s: Stack, replica: str, stream: str = "retool:prompts",
                          group: str = "rollout") -> str | None:
    """A job that the rollout container ``replica`` holds (pending on its consumer, named
    ``<hostname>-<pid>``) and that has a turn checkpoint of at least one sample in Redis (a meta
    field ``m<i>``), read with redis-cli in the redis container; None when there is none. Call it
    with the replica frozen (``docker pause``) so that what it reads cannot change under it."""
    redis = s.container("redis")

    def cli(*args: str) -> bytes:  # bytes: stream entries are msgpack
        return subprocess.run(["docker", "exec", redis, "redis-cli", *args], capture_output=True, timeout=60,
                              check=True).stdout

    host = str(s.inspect(replica, ".Config.Hostname"))
    consumers = json.loads(cli("--json", "XINFO", "CONSUMERS", stream, group) or b"[]")
    mine = [c["name"] for c in consumers if str(c["name"]).startswith(host + "-") and int(c["pending"])]
    ids = [row[0] for name in mine
           for row in json.loads(cli("--json", "XPENDING", stream, group, "-", "+", "100", name) or b"[]")]
    payloads = [cli("XRANGE", stream, i, i) for i in ids]
    for key in cli("--scan", "--pattern", f"{stream}:ckpt:*").decode().split():
        job_id = key.split(":ckpt:", 1)[1]
        if any(job_id.encode() in p for p in payloads) and any(
                f.startswith("m") for f in cli("HKEYS", key).decode().split()):
            return job_id
    return None


def checkpoint_gone(s: Stack, job_id: str, stream: str = "retool:prompts") -> bool:
    """The job's turn checkpoints are gone: deleted in the transaction that published its group."""
    out = run(["docker", "exec", s.container("redis"), "redis-cli", "EXISTS", f"{stream}:ckpt:{job_id}"],
              timeout=60).stdout
    return out.strip() == "0"


def handed_back_in_logs(container: str, since: int) -> int:
    """Jobs the replica in ``container`` logged as handed back since ``since`` (unix seconds)."""
    p = run(["docker", "logs", "--since", str(since), container], timeout=60, check=False)
    n = 0
    for line in (p.stdout + p.stderr).splitlines():
        if line.startswith("{") and '"jobs handed back"' in line:
            n += int(json.loads(line).get("jobs", 0))
    return n


def check_kill_regenerated(d: dict[str, float], max_turn_tokens: int) -> str:
    """SIGKILL mid-generation: the in-flight samples continued, and each regenerated one turn at most."""
    samples = d[RESUMED_SAMPLES] + d[RESTARTED_SAMPLES]
    assert samples >= 1, f"no sample of the killed replica was resumed or restarted (counters: {d})"
    assert d[REGENERATED] <= samples * max_turn_tokens, (
        f"{d[REGENERATED]:.0f} tokens regenerated for {samples:.0f} in-flight samples: more than one turn "
        f"({max_turn_tokens} tokens) each")
    in_flight = d[REGENERATED] + d[RESUMED_TOKENS]
    share = d[REGENERATED] / in_flight if in_flight else 0.0
    return (f"{samples:.0f} in-flight samples continued ({d[RESUMED_SAMPLES]:.0f} resumed, "
            f"{d[RESTARTED_SAMPLES]:.0f} restarted); {d[REGENERATED]:.0f} tokens regenerated = "
            f"{share:.1%} of the {in_flight:.0f} in flight; {d[DISCARDED]:.0f} checkpointed tokens "
            "discarded as stale (the tiny trainer's versions move faster than a re-claim)")


def check_drain_regenerated_nothing(d: dict[str, float]) -> str:
    """SIGTERM (drain): the samples stopped at turn boundaries after their checkpoints: nothing redone."""
    assert d[REGENERATED] == 0, f"{d[REGENERATED]:.0f} tokens regenerated after a drain"
    return (f"0 tokens regenerated ({d[RESUMED_TOKENS]:.0f} resumed in {d[RESUMED_SAMPLES]:.0f} samples, "
            f"{d[RESTARTED_SAMPLES]:.0f} samples restarted, {d[DISCARDED]:.0f} checkpointed tokens "
            "discarded as stale)")


def check_drain_pickup(d: dict[str, float], handed_back: int) -> str:
    """SIGTERM (drain): every handed-back job taken through the hand-back, none after claim_idle_ms."""
    assert d[TAKEN_OVER] == handed_back, f"{handed_back} jobs handed back, {d[TAKEN_OVER]:.0f} taken over"
    assert d[RECLAIMED] == 0, f"{d[RECLAIMED]:.0f} jobs re-claimed after claim_idle_ms during the drain"
    assert d[PICKUPS_IN_BOUND] == d[PICKUPS], (
        f"{d[PICKUPS] - d[PICKUPS_IN_BOUND]:.0f} of {d[PICKUPS]:.0f} pick-ups took over {PICKUP_BOUND_S} s")
    mean = d[PICKUP_SUM] / d[PICKUPS] if d[PICKUPS] else 0.0
    return f"{handed_back} jobs handed back, all taken over (mean pick-up {mean:.2f} s), none re-claimed"

"""Generates the provisioned Grafana dashboards (deploy/grafana/dashboards/*.json).

Run after changing a panel: ``python deploy/grafana/make_dashboards.py``. The test suite
checks the JSON files are what this script writes, and that every metric a panel queries
is exported by a running service.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("dashboards")
DS = {"type": "prometheus", "uid": "prometheus"}


def panel(pid: int, title: str, exprs: dict[str, str], unit: str = "short", x: int = 0, y: int = 0) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(exprs.items())
        ],
    }


def dashboard(uid: str, title: str, panels: list[dict]) -> dict:
    for i, p in enumerate(panels):
        p["gridPos"]["x"], p["gridPos"]["y"] = (i % 2) * 12, (i // 2) * 8
    return {
        "uid": uid,
        "title": title,
        "tags": ["retool"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "panels": panels,
    }


def q(metric: str, quantile: float) -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket[5m])))"


DASHBOARDS = {
    "sandbox": dashboard(
        "retool-sandbox",
        "ReTool / Sandbox",
        [
            panel(
                1,
                "Requests by status",
                {"{{status}}": "sum by (status) (rate(sandbox_requests_total[1m]))"},
                "reqps",
            ),
            panel(
                2,
                "Latency p50 / p99",
                {"p50": q("sandbox_execution_seconds", 0.5), "p99": q("sandbox_execution_seconds", 0.99)},
                "s",
            ),
            panel(3, "Executions in flight", {"in flight": "sum(sandbox_executions_in_flight)"}),
            panel(4, "Queue depth", {"queued": "sum(sandbox_queue_depth)"}),
            panel(
                5,
                "Rejections",
                {"{{reason}}": "sum by (reason) (rate(sandbox_rejections_total[5m]))"},
                "reqps",
            ),
            panel(
                6,
                "Output truncations",
                {"truncated": "sum(rate(sandbox_output_truncations_total[5m]))"},
                "reqps",
            ),
        ],
    ),
    "reward": dashboard(
        "retool-reward",
        "ReTool / Reward",
        [
            panel(1, "Grades per second", {"grades/s": "sum(rate(reward_grades_total[1m]))"}, "reqps"),
            panel(
                2, "Outcome mix", {"{{reason}}": "sum by (reason) (rate(reward_grades_total[5m]))"}, "reqps"
            ),
            panel(3, "Timeouts", {"timeouts/s": "sum(rate(reward_timeouts_total[5m]))"}, "reqps"),
            panel(
                4,
                "Grade latency p50 / p99",
                {"p50": q("reward_grade_seconds", 0.5), "p99": q("reward_grade_seconds", 0.99)},
                "s",
            ),
            panel(
                5,
                "Symbolic checks admitted / idle workers",
                {"admitted": "sum(reward_symbolic_admitted)", "idle": "sum(reward_symbolic_idle_workers)"},
            ),
            panel(
                6,
                "Overload (503/s) and queue wait (s/s)",
                {
                    "503/s": "sum(rate(reward_overloaded_total[5m]))",
                    "wait": "sum(rate(reward_symbolic_wait_seconds_total[5m]))",
                },
            ),
        ],
    ),
    "training": dashboard(
        "retool-training",
        "ReTool / Training",
        [
            panel(
                1,
                "Reward",
                {
                    "score (mean)": "max(trainer_critic_score_mean)",
                    "shaped": "max(trainer_critic_rewards_mean)",
                },
            ),
            panel(
                2, "Accuracy (training groups)", {"accuracy": "max(trainer_rollout_accuracy)"}, "percentunit"
            ),
            panel(3, "Policy loss", {"pg_loss": "max(trainer_actor_pg_loss)"}),
            panel(
                4,
                "Clip fraction",
                {
                    "clipped": "max(trainer_actor_pg_clipfrac)",
                    "dual-clip lower": "max(trainer_actor_pg_clipfrac_lower)",
                },
                "percentunit",
            ),
            panel(
                5,
                "KL (old → new policy)",
                {"k1": "max(trainer_actor_ppo_kl)", "k3": "max(trainer_actor_ppo_kl_k3)"},
            ),
            panel(6, "Entropy", {"entropy": "max(trainer_actor_entropy)"}),
            panel(7, "Grad norm", {"grad norm": "max(trainer_actor_grad_norm)"}),
            panel(8, "Step time", {"step": "max(trainer_perf_step_seconds)",
                                   "feed waited after the update": "max(trainer_perf_feed_wait_seconds)",
                                   "feed read during the update": "max(trainer_perf_feed_overlap_seconds)"},
                  "s"),
            panel(
                9,
                "Trained tokens per second",
                {"tokens/s": "max(trainer_policy_tokens) / max(trainer_perf_step_seconds)"},
            ),
            panel(
                10,
                "Response length",
                {"mean": "max(trainer_response_length_mean)", "max": "max(trainer_response_length_max)"},
            ),
            panel(
                11,
                "Tool use (training groups)",
                {
                    "turns": "max(trainer_rollout_turns_mean)",
                    "tool calls": "max(trainer_rollout_tool_calls_mean)",
                },
            ),
            panel(
                12,
                "Step / policy version",
                {"step": "max(trainer_step)", "version": "max(trainer_policy_version)"},
            ),
            panel(
                13,
                "Rollout–trainer log-prob mismatch |Δ logp|",
                {"mean": "max(trainer_mismatch_abs_mean)", "max": "max(trainer_mismatch_abs_max)"},
            ),
            panel(
                14,
                "Rollout–trainer mismatch: KL and corrections",
                {
                    "k3 KL(rollout‖trainer)": "max(trainer_mismatch_k3_kl)",
                    "tokens at the TIS cap": "max(trainer_mismatch_tis_capped_frac)",
                    "sequences dropped by MIS": "max(trainer_mismatch_mis_masked_frac)",
                },
            ),
        ],
    ),
    "rollout": dashboard(
        "retool-rollout",
        "ReTool / Rollout",
        [
            panel(
                1,
                "Generated tokens per second",
                {"{{instance}}": "sum by (instance) (rate(rollout_generated_tokens_total[1m]))"},
            ),
            panel(
                2,
                "Requests in flight",
                {
                    "HTTP": "sum(rollout_requests_in_flight)",
                    "queue jobs": "sum(rollout_worker_jobs_in_flight)",
                },
            ),
            panel(
                3,
                "Turns per response",
                {
                    "mean": "sum(rate(rollout_turns_sum[5m])) / sum(rate(rollout_turns_count[5m]))",
                    "p90": q("rollout_turns", 0.9),
                },
            ),
            panel(
                4,
                "Tool calls per response",
                {
                    "{{outcome}}": "sum by (outcome) (rate(rollout_tool_calls_total[5m]))"
                    " / scalar(sum(rate(rollout_trajectories_total[5m])))"
                },
            ),
            panel(
                5,
                "Weight version",
                {
                    "{{instance}}": "max by (instance) (rollout_weight_version)",
                    "trainer": "max(trainer_policy_version)",
                },
            ),
            panel(
                6,
                "Weight push time",
                {
                    "receive p50": q("rollout_weight_push_receive_seconds", 0.5),
                    "load p50": q("rollout_weight_load_seconds", 0.5),
                    "trainer push (all replicas)": "max(trainer_weights_push_seconds)",
                },
                "s",
            ),
            panel(
                7,
                "Weight pushes by outcome",
                {"{{outcome}}": "sum by (outcome) (increase(rollout_weight_pushes_total[10m]))"},
            ),
            panel(
                8,
                "Responses by finish reason",
                {"{{reason}}": "sum by (reason) (rate(rollout_trajectories_total[5m]))"},
                "reqps",
            ),
            panel(
                9,
                "Sandbox call latency p50 / p99",
                {"p50": q("rollout_sandbox_seconds", 0.5), "p99": q("rollout_sandbox_seconds", 0.99)},
                "s",
            ),
            panel(
                10,
                "Weight push: bytes on the wire (delta pushes send only changed elements)",
                {
                    "sent, all replicas": "max(trainer_weights_push_wire_bytes)",
                    "a full push, one replica": "max(trainer_weights_push_full_bytes)",
                },
                "bytes",
            ),
            panel(
                11,
                "Weight push: changed elements (density)",
                {"density": "max(trainer_weights_push_density)"},
                "percentunit",
            ),
            panel(
                12,
                "Weight push phases (trainer)",
                {
                    "encode": "max(trainer_weights_push_encode_seconds)",
                    "wire": "max(trainer_weights_push_wire_seconds)",
                    "load": "max(trainer_weights_push_load_seconds)",
                    "total": "max(trainer_weights_push_seconds)",
                },
                "s",
            ),
            panel(
                13,
                "Weight pushes applied by kind; full-push fallbacks",
                {
                    "{{kind}}": "sum by (kind) (increase(rollout_weight_pushes_applied_total[10m]))",
                    "delta refused, full sent": "max(trainer_weights_push_fallbacks)",
                    "replicas skipped (unreachable)": "max(trainer_weights_push_unreachable)",
                },
            ),
        ],
    ),
    "queues": dashboard(
        "retool-queues",
        "ReTool / Queues",
        [
            panel(
                1, "Stream depth", {"{{stream}}": 'max by (stream) (trainer_queue_messages{kind="depth"})'}
            ),
            panel(
                2,
                "Groups: undelivered (lag) and unacknowledged (pending)",
                {"{{kind}}": 'max by (kind) (trainer_queue_messages{stream="groups", kind=~"lag|pending"})'},
            ),
            panel(
                3,
                "Staleness (policy versions)",
                {
                    "trained groups (mean)": "max(trainer_rollout_staleness_mean)",
                    "oldest replica": "max(trainer_policy_version) - min(rollout_weight_version)",
                    "limit": "max(trainer_max_staleness)",
                },
            ),
            panel(
                4,
                "Dropped groups",
                {"{{reason}}": "sum by (reason) (increase(trainer_dropped_groups_total[5m]))"},
            ),
            panel(
                5,
                "Rollout queue jobs by outcome",
                {"{{outcome}}": "sum by (outcome) (delta(rollout_worker_jobs[5m]))"},
            ),
            panel(6, "Sandbox queue", {"queued runs": "sum(sandbox_queue_depth)"}),
        ],
    ),
}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(d, indent=2, sort_keys=True) + "\n" for name, d in DASHBOARDS.items()}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")

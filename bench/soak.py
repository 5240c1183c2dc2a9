"""Soak benchmark (not a CI test): the tiny pipeline for many steps, watching for unbounded growth.

Starts a private Redis, sandbox, reward, rollout (transformers engine, Redis worker, gRPC + shared
memory weight server) and ``retool trainer run`` with dynamic sampling on, validation every
``--test-freq`` steps and a checkpoint every ``--save-freq`` steps. The policy is the branching
test model (``\\boxed{d}``, d uniform in 1..4: a third of the groups are dropped, so admission,
drops and their acknowledgements all run for the whole soak).

At step 10, every ``--every`` steps and at the end it samples, per service (its whole process
tree): resident memory (RSS) and open file descriptors; Redis ``used_memory``, the length and
pending count of every stream; ``/dev/shm`` segments (count, bytes); the mean step time of the
last 10 steps. It prints a table (markdown) and writes ``soak.json``; growth between step 10 and
the end is reported per row (ratio), and rows that grow more than ``--max-growth`` × are flagged.

Usage: ``python bench/soak.py --steps 200 --out runs/soak``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.process import ServiceProcess, free_port  # noqa: E402
from services.common.redis_server import PrivateRedis  # noqa: E402
from services.demo.task import rl_rows, write_parquet  # noqa: E402
from services.sandbox.launcher import SandboxProcess  # noqa: E402
from services.stack.local import start_tool_services  # noqa: E402
from tests.helpers.scripted_model import branching_model_dir  # noqa: E402

TOKEN_ENV = "RETOOL_WEIGHT_TOKEN"


# ---- /proc readings ---------------------------------------------------------------------------
def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (a process that exits while it is read is skipped: its
    ``/proc`` directory can vanish in the middle of the walk, e.g. a sandbox run ending)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").glob("*/children"))
        except OSError:
            continue
        for children in tasks:
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in children.read_text().split())
    return out


def rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


def open_fds(pids: list[int]) -> int:
    n = 0
    for p in pids:
        with contextlib.suppress(OSError):
            n += len(os.listdir(f"/proc/{p}/fd"))
    return n


def shm_entries() -> dict[str, int]:
    out = {}
    for e in Path("/dev/shm").iterdir():
        with contextlib.suppress(OSError):
            if e.is_file():
                out[e.name] = e.stat().st_size
    return out


def shm_held(pids: list[int]) -> set[str]:
    """``/dev/shm`` files our processes map or hold open (other jobs on a shared machine excluded)."""
    held = set()
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line.split("/dev/shm/", 1)[1].split()[0])
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target.removeprefix("/dev/shm/").split()[0])
    return held


SHM_AT_START: dict[str, int] = {}


async def redis_stats(url: str) -> dict[str, float]:
    from services.common.queue import connect

    client = connect(url)
    try:
        out: dict[str, float] = {"redis used_memory MB": (await client.info("memory"))["used_memory"] / 2**20}
        async for key in client.scan_iter(_type="STREAM"):
            name = _text(key)
            out[f"XLEN {name}"] = float(await client.xlen(name))
            for g in await client.xinfo_groups(name):
                out[f"pending {name} [{_text(g['name'])}]"] = float(g["pending"])
        return out
    finally:
        await client.aclose()


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def sample(step: int, services: dict[str, int], redis_url: str, step_seconds: list[float]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step}
    everyone: list[int] = []
    for name, pid in services.items():
        if not Path(f"/proc/{pid}").exists():  # exited (the trainer, after its last step)
            row[f"RSS {name} MB"] = row[f"fds {name}"] = None
            continue
        pids = tree(pid)
        everyone += pids
        row[f"RSS {name} MB"] = rss_mb(pids)
        row[f"fds {name}"] = open_fds(pids)
    row.update(asyncio.run(redis_stats(redis_url)))
    entries = shm_entries()
    held = shm_held(everyone)
    new = set(entries) - set(SHM_AT_START)
    row["/dev/shm segments held by the services"] = len(held)
    row["/dev/shm MB held by the services"] = round(sum(entries.get(n, 0) for n in held) / 2**20, 1)
    row["/dev/shm retool-* created since start"] = sum(n.startswith("retool-") for n in new)
    last = step_seconds[-10:]
    row["step s (mean of last 10)"] = round(sum(last) / len(last), 3) if last else None
    return row


# ---- the run ----------------------------------------------------------------------------------
def trainer_config(out: Path, model: Path, redis_url: str, grpc: str, http: str, args: argparse.Namespace
                   ) -> Path:
    prompts = 400
    train = write_parquet(out / "data" / "rl.parquet", rl_rows([(1, 1 + i % 4) for i in range(prompts)], "t"))
    val = write_parquet(out / "data" / "val.parquet", rl_rows([(1, 1 + i % 4) for i in range(8)], "v"))
    cfg = {
        "dataset": str(train),
        "val_dataset": str(val),
        "rollout_urls": [http],
        "val_sampling": {"temperature": 1.0, "max_tokens": 16},
        "redis_url": redis_url,
        "rollout_targets": [grpc],
        "weight_token_env": TOKEN_ENV,
        "weight_transport": "shm",
        "max_steps": args.steps,
        "metrics_path": str(out / "metrics.jsonl"),
        "metrics_port": free_port(),
        "group_wait_s": 300,
        "sampling": {"temperature": 1.0, "max_tokens": 16},
        "max_turns": 1,
        "trainer": {
            "model_path": str(model),
            "batch_prompts": 4,
            "group_size": 4,
            "mini_batch_size": 8,
            "max_prompt_len": 64,
            "max_response_len": 16,
            "micro_batch_max_tokens": 512,
            "lr": 1e-5,
            "save_freq": args.save_freq,
            "test_freq": args.test_freq,
            "val_n": 2,
            "keep_last_checkpoints": 2,
            "checkpoint_dir": str(out / "ckpt"),
            # dropped groups use prompts too: enough passes over the data for every step
            "total_epochs": -(-args.steps * 4 * 2 // prompts),
            "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
        },
    }
    path = out / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50, help="sample every N steps (besides 10 and the end)")
    ap.add_argument("--save-freq", type=int, default=20)
    ap.add_argument("--test-freq", type=int, default=25)
    ap.add_argument("--max-growth", type=float, default=1.5)
    ap.add_argument("--out", default="runs/soak")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    logs = out / "logs"
    model = branching_model_dir(out / "model", "\\boxed{", ["1", "2", "3", "4"], "}")
    SHM_AT_START.update(shm_entries())
    token = secrets.token_hex(16)
    threads = {"OMP_NUM_THREADS": "1"}
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(PrivateRedis(out / "redis", "redis-server"))
        sandbox_url, reward_url = start_tool_services(stack, logs)
        grpc_port = free_port()
        rollout = stack.enter_context(ServiceProcess(
            ["rollout", "serve", "--model", str(model), "--grpc-port", str(grpc_port),
             "--sandbox-url", sandbox_url, "--reward-url", reward_url, "--redis-url", redis.url,
             "--weight-token-env", TOKEN_ENV, "--set", "redis.block_ms=100", "--set", "redis.concurrency=8"],
            env={TOKEN_ENV: token, **threads}, log_path=logs / "rollout.log", startup_timeout_s=180))
        cfg = trainer_config(out, model, redis.url, f"127.0.0.1:{grpc_port}", rollout.url, args)
        log = (logs / "trainer.log").open("wb")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "trainer", "run", "--config", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: token, **threads},
            start_new_session=True)
        stack.callback(lambda: trainer.poll() is None and trainer.kill())
        services = {"trainer": trainer.pid, "rollout": rollout.proc.pid, "reward": 0, "sandbox": 0,
                    "redis": redis._proc.pid if redis._proc else 0}
        for proc in _services_started(stack):
            services[proc[0]] = proc[1]
        services = {k: v for k, v in services.items() if v}
        next_at = 10
        while True:
            rows = [m for m in metrics_rows(out / "metrics.jsonl") if "perf/step_seconds" in m]
            step = rows[-1]["step"] if rows else 0
            done = trainer.poll() is not None
            last = step >= args.steps and not (samples and samples[-1]["step"] == step)
            if step >= next_at or last or (done and not (samples and samples[-1]["step"] == step)):
                # the last step's sample is taken as soon as its metrics line appears, while the
                # trainer writes its final checkpoint (it exits right after)
                times = [m["perf/step_seconds"] for m in rows]
                samples.append(sample(step, services, redis.url, times))
                print(f"[{time.monotonic() - start:7.1f}s] step {step}: "
                      f"{ {k: v for k, v in samples[-1].items() if k.startswith(('RSS', 'fds', 'redis'))} }",
                      file=sys.stderr, flush=True)
                next_at = 10 if next_at < 10 else (next_at // args.every + 1) * args.every
            if done:
                break
            time.sleep(0.3)
        log.close()
        if trainer.returncode != 0:
            sys.exit(f"trainer exited with {trainer.returncode}; see {logs / 'trainer.log'}")
    all_rows = metrics_rows(out / "metrics.jsonl")
    report = {
        "steps": max((m["step"] for m in all_rows if "perf/step_seconds" in m), default=0),
        "validations": sum(1 for m in all_rows if any(k.startswith("val-") for k in m)),
        "dropped_filtered": sum(m.get("rollout/dropped_filtered", 0.0) for m in all_rows),
        "wall_s": round(time.monotonic() - start, 1),
        "samples": samples,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(table(samples, args.max_growth))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))


def _services_started(stack: contextlib.ExitStack) -> list[tuple[str, int]]:
    """The sandbox and reward processes ``start_tool_services`` entered into ``stack``."""
    found = []
    for cb in stack._exit_callbacks:  # (is_sync, callback) pairs; bound __exit__ of each service
        obj = getattr(cb[1], "__self__", None)
        if isinstance(obj, ServiceProcess) and obj.proc is not None:
            found.append(("sandbox" if isinstance(obj, SandboxProcess) else obj.args[0], obj.proc.pid))
    return found


def table(samples: list[dict[str, Any]], max_growth: float) -> str:
    if not samples:
        return "(no samples)"
    first = next((s for s in samples if s["step"] >= 10), samples[0])
    last = samples[-1]
    keys = [k for k in last if k != "step"]
    head = "| metric | " + " | ".join(f"step {s['step']}" for s in samples) + " | end / step 10 |"
    lines = [head, "|" + "---|" * (len(samples) + 2)]
    for k in keys:
        vals = [s.get(k) for s in samples]
        a, b = first.get(k), last.get(k)
        ratio = "" if not a or b is None else f"{b / a:.2f}"
        flag = " ⚠" if ratio and float(ratio) > max_growth and not k.startswith("step s") else ""
        cells = " | ".join("" if v is None else f"{v:g}" for v in vals)
        lines.append(f"| {k} | {cells} | {ratio}{flag} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Scale benchmark: the real services at the recipe's shapes, around an engine that costs nothing.

Starts a private Redis, the sandbox (``--sandbox-workers``, 128 as the recipe), the reward service,
``--replicas`` rollout replicas on ``engine: synthetic`` (preset ``--preset``) and ``retool trainer
run`` in ``step_mode=null`` (real feed, packing and a ``--payload-mb`` push over gRPC; no forward or
backward). Shapes: ``--prompts`` x 16 responses per step, prompts up to 2,048 tokens, responses up to
16,384 tokens, up to 8 tool turns (the recipe's, scaled down in prompt count only; ``--quick`` also
shortens the reasoning so that CI finishes in minutes, and says so in its output).

Reports (table on stdout, JSON in ``<out>/scale.json``, the figure in ``<out>/scale.png``:
``bench/scale_figure.py``):
- CPU-seconds per 1M tokens of each component's process tree (``/proc/<pid>/stat``: utime + stime of
  the live processes and cutime + cstime of the reaped ones), the rollout process minus the engine's
  own step work (``engine_cpu_s``, what vLLM's GPU work would be) also apart;
- wire bytes per token (every groups-stream entry read back and decoded), Redis peak memory
  (``INFO memory``) against the admission bound, sandbox calls/s and grades/s per core, the
  engine-idle fraction, a per-step breakdown.
Fails (exit 1) when a component exits or the trainer's ledger check fails.

Usage: ``python bench/scale.py --quick`` | ``python bench/scale.py --prompts 4 --steps 5 --preset h100-7b``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import tree  # noqa: E402
from services.common.process import ServiceProcess, free_port  # noqa: E402
from services.common.redis_server import PrivateRedis  # noqa: E402
from services.demo.task import write_parquet  # noqa: E402
from services.rollout.engine.synthetic_script import answer_for  # noqa: E402
from services.stack.local import start_tool_services  # noqa: E402

TOKEN_ENV = "RETOOL_WEIGHT_TOKEN"
CLK = os.sysconf("SC_CLK_TCK")
PROBE_BATCH = 4  # groups per XRANGE reply of the wire probe (its reply buffer counts in Redis memory)
REDIS_SLACK = 8 << 20  # Redis's own allocator and client buffers, beyond the groups it holds
PROMPT_PAD = " Consider all cases carefully and justify each step of the computation."


# ---- /proc CPU ------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid``'s tree: live processes' own time plus what their reaped children used."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / CLK


# ---- the data ------------------------------------------------------------------------------------
def rows(n: int, prompt_words: int, prefix: str) -> list[dict[str, Any]]:
    out = []
    for k in range(n):
        pad = PROMPT_PAD * max(0, prompt_words // 11)
        content = (f"Solve the following math problem step by step. Problem #{k}: find the value of the "
                   f"expression described below.{pad}\n\nRemember to put your answer on its own line after "
                   "\"Answer:\".")
        out.append({"data_source": "math_dapo", "prompt": [{"role": "user", "content": content}],
                    "ability": "MATH",
                    "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": str(answer_for(k))},
                    "extra_info": {"index": f"{prefix}-{k}"}})
    return out


def trainer_config(out: Path, model: Path, redis_url: str, grpcs: list[str], http: str,
                   args: argparse.Namespace) -> Path:
    prompts = args.prompts * (args.steps + 2)
    train = write_parquet(out / "data" / "rl.parquet", rows(prompts, args.prompt_words, "t"))
    val = write_parquet(out / "data" / "val.parquet", rows(1, args.prompt_words, "v"))  # last step validates
    cfg = {
        "dataset": str(train), "val_dataset": str(val), "rollout_urls": [http], "redis_url": redis_url,
        "rollout_targets": grpcs, "weight_token_env": TOKEN_ENV, "max_steps": args.steps,
        "metrics_path": str(out / "metrics.jsonl"), "group_wait_s": args.group_wait_s,
        "sampling": {"temperature": 1.0, "max_tokens": args.max_response}, "max_turns": 8,
        "trainer": {
            "model_path": str(model), "step_mode": "null", "null_push_mb": args.payload_mb,
            "batch_prompts": args.prompts, "group_size": 16, "mini_batch_size": 16,
            "max_prompt_len": 2048, "max_response_len": args.max_response,
            "micro_batch_max_tokens": 2048 + args.max_response, "max_staleness": 1,
            "save_freq": args.save_freq, "test_freq": 1000, "val_n": 1, "val_before_train": False,
            "dynamic_sampling": {"enabled": False}, "checkpoint_dir": str(out / "ckpt"),
            "fsdp": {"param_dtype": "fp32", "gradient_checkpointing": False},
        },
    }
    path = out / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---- Redis probes --------------------------------------------------------------------------------
class WireProbe:
    """Reads every new entry of the groups stream (by id, once), sums its bytes and decodes it."""

    def __init__(self, url: str, stream: str = "retool:groups") -> None:
        self.url, self.stream = url, stream
        self.last = "0-0"
        self.bytes = self.tokens = self.groups = self.max_entry = 0
        self.peak_memory = 0
        self.base_memory: int | None = None  # used_memory at the first poll (before any group)

    async def poll(self) -> None:
        from services.common.queue import connect
        from services.common.schemas import Group

        client = connect(self.url)
        try:
            info = await client.info("memory")
            self.peak_memory = max(self.peak_memory, int(info["used_memory_peak"]))
            if self.base_memory is None:
                self.base_memory = int(info["used_memory"])
            while True:
                entries = await client.xrange(self.stream, min=f"({self.last}", count=PROBE_BATCH)
                if not entries:
                    break
                for eid, fields in entries:
                    self.last = eid.decode() if isinstance(eid, bytes) else eid
                    raw = fields.get(b"d") or b""
                    size = sum(len(k) + len(v) for k, v in fields.items())
                    self.bytes += size
                    self.max_entry = max(self.max_entry, size)
                    with contextlib.suppress(ValueError):
                        group = Group.from_msgpack(raw)
                        self.groups += 1
                        self.tokens += sum(len(t.response_ids) for t in group.trajectories)
        finally:
            await client.aclose()


def scrape(url: str) -> dict[str, float]:
    """Prometheus text of ``url``/metrics, summed by metric name (labels dropped)."""
    import httpx

    out: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name.split("{", 1)[0]
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def _metric(scraped: dict[str, float], suffix: str) -> float:
    return sum(v for k, v in scraped.items() if k.endswith(suffix))


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---- the run -------------------------------------------------------------------------------------
def engine_kwargs(args: argparse.Namespace, stats: Path) -> list[str]:
    kw = {"preset": args.preset, "payload_mb": args.payload_mb, "stats_path": str(stats),
          "reasoning_tokens_mean": args.reasoning_tokens, "tool_calls_mean": args.tool_calls_mean,
          "stream_interval": args.stream_interval, "seed": args.seed}
    return [x for k, v in kw.items() for x in ("--set", f"engine_kwargs.{k}={v}")]


def start_rollouts(stack: contextlib.ExitStack, args: argparse.Namespace, out: Path, model: Path,
                   sandbox_url: str, reward_url: str, redis_url: str, token: str
                   ) -> list[tuple[ServiceProcess, str, Path]]:
    replicas = []
    for i in range(args.replicas):
        grpc_port = free_port()
        stats = out / f"engine-{i}.json"
        proc = stack.enter_context(ServiceProcess(
            ["rollout", "serve", "--model", str(model), "--set", "engine=synthetic",
             "--grpc-port", str(grpc_port), "--sandbox-url", sandbox_url, "--reward-url", reward_url,
             "--redis-url", redis_url,
             "--weight-token-env", TOKEN_ENV, "--set", "redis.block_ms=100",
             "--set", f"redis.concurrency={args.prompts}", "--set", "max_prompt_tokens=2048",
             "--set", "agent.include_text=false", *engine_kwargs(args, stats)],
            env={TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}, log_path=out / "logs" / f"rollout-{i}.log",
            startup_timeout_s=180))
        replicas.append((proc, f"127.0.0.1:{grpc_port}", stats))
    return replicas


def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.models.tiny import init_model_dir

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        init_model_dir(model, "small", 0)
    token = secrets.token_hex(16)
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(PrivateRedis(out / "redis", "redis-server"))
        sandbox_url, reward_url = start_tool_services(stack, out / "logs",
                                                      sandbox_concurrency=args.sandbox_workers)
        replicas = start_rollouts(stack, args, out, model, sandbox_url, reward_url, redis.url, token)
        cfg = trainer_config(out, model, redis.url, [g for _, g, _ in replicas], replicas[0][0].url, args)
        log = (out / "logs" / "trainer.log").open("wb")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "trainer", "run", "--config", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1"})
        stack.callback(lambda: trainer.poll() is None and trainer.kill())
        pids = {"redis": redis._proc.pid if redis._proc else 0, "trainer": trainer.pid,
                **{f"rollout-{i}": p.proc.pid for i, (p, _, _) in enumerate(replicas) if p.proc},
                **dict(_tool_pids(stack))}
        cpu0: dict[str, float] = {}  # taken when the first token is generated: start-up left out
        cpu1: dict[str, float] = {}
        scraped0 = {k: scrape(u) for k, u in (("sandbox", sandbox_url), ("reward", reward_url))}
        probe = WireProbe(redis.url)
        failed = None
        while trainer.poll() is None:
            for k, v in pids.items():  # the last reading of each tree (the trainer exits at the end)
                if cpu0 and v and Path(f"/proc/{v}").exists():
                    cpu1[k] = max(cpu1.get(k, 0.0), cpu_seconds(v))
            asyncio.run(probe.poll())
            done = [m for m in metrics_rows(out / "metrics.jsonl") if "perf/step_seconds" in m]
            gen = sum(_engine(s).get("tokens", 0) for _, _, s in replicas)
            if gen and not cpu0:
                cpu0 = {k: cpu_seconds(v) for k, v in pids.items() if v}
            print(f"\r[{time.monotonic() - start:6.0f}s] step {len(done)}/{args.steps}  "
                  f"engine tokens {gen:,}  "
                  f"groups on the wire {probe.groups}  redis peak {probe.peak_memory / 2**20:.0f} MiB   ",
                  end="", file=sys.stderr, flush=True)
            dead = [i for i, (p, _, _) in enumerate(replicas) if p.proc and p.proc.poll() is not None]
            if dead:
                failed = f"a rollout replica exited: {dead}"
                break
            time.sleep(1.0)
        print(file=sys.stderr)
        asyncio.run(probe.poll())
        wall = time.monotonic() - start
        for k, v in pids.items():
            if v and Path(f"/proc/{v}").exists():
                cpu1[k] = max(cpu1.get(k, 0.0), cpu_seconds(v))
        scraped1 = {k: scrape(u) for k, u in (("sandbox", sandbox_url), ("reward", reward_url))}
        rollout_metrics = [scrape(p.url) for p, _, _ in replicas]
        log.close()
        if failed is None and trainer.returncode != 0:
            failed = f"trainer exited with {trainer.returncode}; see {out / 'logs' / 'trainer.log'}"
    return report(args, out, wall, cpu0, cpu1, scraped0, scraped1, rollout_metrics,
                  [_engine(s) for _, _, s in replicas], probe, failed)


def _engine(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def _tool_pids(stack: contextlib.ExitStack) -> list[tuple[str, int]]:
    from bench.soak import _services_started

    return [(n, p) for n, p in _services_started(stack) if n in ("sandbox", "reward")]


def report(args: argparse.Namespace, out: Path, wall: float, cpu0: dict[str, float], cpu1: dict[str, float],
           s0: dict[str, dict[str, float]], s1: dict[str, dict[str, float]], rollout: list[dict[str, float]],
           engines: list[dict[str, Any]], probe: WireProbe, failed: str | None) -> dict[str, Any]:
    from services.trainer.ledger import check_file, ledger_path

    steps = [m for m in metrics_rows(out / "metrics.jsonl") if "perf/step_seconds" in m]
    tokens = sum(e.get("tokens", 0) for e in engines)
    cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    rollout_cpu = sum(v for k, v in cpu.items() if k.startswith("rollout"))
    engine_cpu = sum(e.get("engine_cpu_s", 0.0) for e in engines)
    per_m = {k: round(v / max(tokens, 1) * 1e6, 2) for k, v in cpu.items()}
    per_m["rollout minus engine step work"] = round((rollout_cpu - engine_cpu) / max(tokens, 1) * 1e6, 2)
    ledger = check_file(ledger_path(out / "ckpt"))
    cores = os.cpu_count() or 1
    window = max((e.get("span_s", 0.0) for e in engines), default=0.0) or wall  # first request to end
    calls = _metric(s1["sandbox"], "requests_total") - _metric(s0["sandbox"], "requests_total")
    calls = calls or sum(_metric(r, "tool_calls_total") for r in rollout)
    grades = sum(_metric(r, "trajectories_total") for r in rollout)
    busy = sum(e.get("busy_s", 0.0) for e in engines)
    span = sum(e.get("span_s", 0.0) for e in engines)
    n = max(len(steps), 1)
    # admission: at most (max_staleness + 1) x prompts groups in flight or held, plus the trained
    # groups not acknowledged yet (acknowledged and deleted with each checkpoint, every save_freq)
    groups_bound = (min(args.steps, args.save_freq) + 1 + 1) * args.prompts
    bound = ((probe.base_memory or 0) + REDIS_SLACK
             + (groups_bound * 1.1 + PROBE_BATCH) * probe.max_entry)  # 10%: stream/listpack overhead
    result = {
        "step_mode": "null", "preset": args.preset, "quick": args.quick, "failed": failed,
        "shape": {"prompts_per_step": args.prompts, "responses_per_step": 16 * args.prompts,
                  "max_response_tokens": args.max_response, "max_tool_turns": 8, "replicas": args.replicas,
                  "sandbox_workers": args.sandbox_workers, "reasoning_tokens_mean": args.reasoning_tokens,
                  "tool_calls_mean": args.tool_calls_mean, "payload_mb": args.payload_mb},
        "steps": len(steps), "wall_s": round(wall, 1), "generated_tokens": tokens,
        "rollout_tok_per_s": round(tokens / max(span / max(len(engines), 1), 1e-9), 1),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "engine_cpu_s": round(engine_cpu, 2),
        "cpu_s_per_1M_tokens": per_m,
        "us_per_token_rollout_minus_engine": per_m["rollout minus engine step work"],
        "wire_bytes_per_token": round(probe.bytes / max(probe.tokens, 1), 2),
        "wire_groups": probe.groups, "redis_peak_mib": round(probe.peak_memory / 2**20, 1),
        "redis_bound_mib": round(bound / 2**20, 1), "redis_bound_groups": groups_bound,
        "largest_group_mib": round(probe.max_entry / 2**20, 2),
        "redis_bound_holds": probe.peak_memory <= bound,
        "sandbox_calls": calls, "window_s": round(window, 1),
        "sandbox_calls_per_s_per_core": round(calls / window / cores, 2),
        "grades_per_s_per_core": round(grades / window / cores, 2),
        "engine_idle_fraction": round(1 - busy / span, 3) if span else None,
        "per_step_s": {
            "step": round(sum(m["perf/step_seconds"] for m in steps) / n, 2),
            "generation (engine busy)": round(busy / n, 2),
            "tools (sum over trajectories)": round(
                sum(_metric(r, "sandbox_seconds_sum") for r in rollout) / n, 2),
            "trainer feed: packing": round(sum(m.get("null/pack_seconds", 0.0) for m in steps) / n, 3),
            "push": round(sum(m.get("weights/push_seconds", 0.0) for m in steps) / n, 3),
        },
        "ledger": {"ok": ledger.ok, "trained_groups": ledger.trained_groups,
                   "violations": ledger.violations[:5]},
    }
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    from bench.scale_figure import render

    render(result, out / "scale.png")
    return result


# ---- the ceiling of one rollout process ------------------------------------------------------------
def ceilings(args: argparse.Namespace) -> dict[str, Any]:
    """The ceiling of this tree and, with ``--baseline-ref``, of that git revision (exported to a
    temporary directory and run the same way, in the same run): before/after and their ratio."""
    import tempfile

    results: dict[str, Any] = {}
    if args.baseline_ref:
        with tempfile.TemporaryDirectory(prefix="scale-baseline-") as tmp:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline_ref],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            results["before"] = ceiling(args, "before", tmp)
    results["after"] = ceiling(args, "after", str(ROOT))
    if "before" in results:
        b, a = results["before"], results["after"]
        results["after/before tok_per_s"] = round(a["tok_per_s"] / max(b["tok_per_s"], 1e-9), 2)
        results["after/before us_per_token_ours"] = round(a["us_per_token_ours"] / max(b["us_per_token_ours"],
                                                                                      1e-9), 2)
    Path(args.out, "ceiling.json").write_text(json.dumps(results, indent=2))
    return results


def ceiling(args: argparse.Namespace, label: str, tree: str) -> dict[str, Any]:
    """One replica (code from ``tree``) on the ``infinite`` engine, no tools (one turn of
    ``--ceiling-tokens``), fed ``--ceiling-requests`` concurrent requests of n=16 over HTTP: tokens/s
    and our CPU per token. With ``--profile`` the replica runs under ``py-spy record`` and the hottest
    frames are summarised."""
    import httpx

    from services.models.tiny import init_model_dir

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        init_model_dir(model, "small", 0)
    stats = out / f"ceiling-{label}-engine.json"
    stats.unlink(missing_ok=True)
    raw = out / f"ceiling-{label}-profile.raw"
    kw = {"preset": "infinite", "stats_path": str(stats), "tool_calls_mean": 0.0,
          "reasoning_tokens_mean": args.ceiling_tokens, "stream_interval": args.stream_interval}
    spy = [str(Path(sys.executable).parent / "py-spy"), "record", "-o", str(raw), "-f", "raw", "-r", "100",
           "--"] if args.profile else []
    with ServiceProcess(["rollout", "serve", "--model", str(model), "--set", "engine=synthetic",
                         "--set", "agent.include_text=false",
                         *[x for k, v in kw.items() for x in ("--set", f"engine_kwargs.{k}={v}")]],
                        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": tree},
                        log_path=out / f"ceiling-{label}-rollout.log",
                        startup_timeout_s=180, wrapper=spy) as proc:
        pid = proc.proc.pid if proc.proc else 0
        body = {"messages": [{"role": "user", "content": "Problem #1: compute it."}], "n": 16,
                "max_turns": 0, "sampling": {"temperature": 1.0, "max_tokens": 16384}}

        async def one(client: httpx.AsyncClient) -> None:
            (await client.post(f"{proc.url}/v1/rollouts", json=body, timeout=3600)).raise_for_status()

        async def all_of() -> None:
            async with httpx.AsyncClient() as client:
                await asyncio.gather(*(one(client) for _ in range(args.ceiling_requests)))

        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        asyncio.run(all_of())
        wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
        time.sleep(1.5)  # the engine's counters file is written every second
        eng = _engine(stats)
        if args.profile and proc.proc is not None:
            os.killpg(proc.proc.pid, signal.SIGINT)  # py-spy writes its samples when the target exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(60)
    tokens = eng.get("tokens", 0)
    result = {"tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
              "cpu_s": round(cpu, 2), "engine_cpu_s": round(eng.get("engine_cpu_s", 0.0), 2),
              "us_per_token_process": round(cpu / max(tokens, 1) * 1e6, 2),
              "us_per_token_ours": round((cpu - eng.get("engine_cpu_s", 0.0)) / max(tokens, 1) * 1e6, 2),
              "stream_interval": args.stream_interval}
    if args.profile and raw.exists():
        result["profile_top"] = hottest(raw)
        (out / f"ceiling-{label}-profile.txt").write_text("\n".join(result["profile_top"]))
    return result


def hottest(raw: Path, top: int = 20) -> list[str]:
    """py-spy raw (collapsed) stacks of the serving event loop (start-up imports left out): the ``top``
    frames by self samples, then our own functions (``services/``) by inclusive samples."""
    self_n: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "asyncio/runners.py" not in stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in {f.rsplit(":", 1)[0] + ")" for f in frames if "(services/" in f}:
            incl[f] = incl.get(f, 0) + n
    lines = [f"event-loop samples: {total}", "self:"]
    lines += _ranked(self_n, total, top)
    lines.append("inclusive, services/ functions:")
    lines += _ranked(incl, total, top)
    return lines


def _ranked(counts: dict[str, int], total: int, top: int) -> list[str]:
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [f"{100 * n / max(total, 1):5.1f}%  {f}" for f, n in ranked]


def table(r: dict[str, Any]) -> str:
    lines = ["| figure | value |", "|---|---|",
             f"| step_mode | {r['step_mode']} (forward/backward skipped) |"]
    for key in ("preset", "steps", "wall_s", "generated_tokens", "rollout_tok_per_s",
                "us_per_token_rollout_minus_engine", "wire_bytes_per_token", "redis_peak_mib",
                "redis_bound_mib", "redis_bound_holds",
                "sandbox_calls_per_s_per_core", "grades_per_s_per_core", "engine_idle_fraction"):
        lines.append(f"| {key} | {r[key]} |")
    lines += [f"| CPU-s per 1M tokens: {k} | {v} |" for k, v in r["cpu_s_per_1M_tokens"].items()]
    lines += [f"| per step: {k} | {v} |" for k, v in r["per_step_s"].items()]
    lines.append(f"| ledger check | {'ok' if r['ledger']['ok'] else r['ledger']['violations']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI: 1 prompt x 16, short reasoning, 2 steps")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (x 16 responses)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--preset", default="infinite", choices=["infinite", "h100-7b", "h200-32b-tp4"])
    ap.add_argument("--sandbox-workers", type=int, default=128)
    ap.add_argument("--max-response", type=int, default=16384)
    ap.add_argument("--prompt-words", type=int, default=400, help="prompt padding (up to 2,048 tokens)")
    ap.add_argument("--reasoning-tokens", type=int, default=900)
    ap.add_argument("--tool-calls-mean", type=float, default=5.0)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--payload-mb", type=float, default=64.0)
    ap.add_argument("--save-freq", type=int, default=2, help="checkpoint (and acknowledge groups) every N")
    ap.add_argument("--group-wait-s", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/scale")
    ap.add_argument("--ceiling", action="store_true", help="only the ceiling of one rollout process")
    ap.add_argument("--ceiling-requests", type=int, default=16, help="concurrent requests of n=16")
    ap.add_argument("--ceiling-tokens", type=int, default=2000, help="tokens per response (one turn)")
    ap.add_argument("--profile", action="store_true", help="run the ceiling replica under py-spy")
    ap.add_argument("--baseline-ref", help="git revision whose ceiling is measured first (before/after)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.steps, args.reasoning_tokens, args.payload_mb = 1, 2, 120, 8.0
        args.sandbox_workers, args.prompt_words = min(args.sandbox_workers, 16), 40
    if args.ceiling:
        print(json.dumps(ceilings(args), indent=2))
        return 0
    r = run(args)
    print(table(r))
    print(json.dumps({k: r[k] for k in ("steps", "failed", "ledger")}))
    ok = r["failed"] is None and r["ledger"]["ok"] and r["steps"] == args.steps and r["redis_bound_holds"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Weight-push benchmark: gRPC push into a running replica process vs a disk checkpoint round trip.

Ours: the trainer holds a state dict in memory and streams it over gRPC on loopback to a rollout
replica running as a separate process (``retool rollout serve --grpc-port``, or with
``--replica bare`` just an HF engine + the weight-push server), which stages it and loads it into
the engine; the clock stops when the replica answers, i.e. after the weights are *received and
loaded*.
Ours, colocated ("gRPC-controlled shared memory"): the same replica process, but the weights go
through its two persistent shared-memory segments (``push_state_dict_shm``: RegisterShm -> one copy
of every tensor into the free segment -> CommitShm -> the engine adopts the segment's tensors, no
copy); only valid when trainer and replica share the machine, the uid and ``/dev/shm``. Its first
push creates and allocates both segments and maps them into both processes, the second is the
first into segment 1; both are reported as "cold", the median of the following pushes is the
steady state (clock from the first RPC to the commit's reply).
Baselines, in the bench process itself (no process hop, which flatters them); each starts from the
trainer's model in memory and ends with the new weights in a model that serves:
- "disk -> serving model" (the honest baseline, the one the targets are judged against):
  ``save_pretrained`` of the trainer's model (the write reaches the page cache, no fsync), then the
  already-resident serving model reloads it: ``safetensors.torch.load_file`` +
  ``load_state_dict`` into its parameters. Every weight byte is written, read back and copied into
  the serving weights — the same end state as a push. The serving model's weights are private,
  already-touched memory (like the replica's after its first push), so no page fault is charged;
- "... + fsync": the same with ``fsync`` of every file before the reload (a checkpoint that is
  really on disk, as a trainer would need to survive a crash);
- "lazy from_pretrained" (kept for comparison, *not* an honest baseline): ``save_pretrained`` +
  ``from_pretrained`` of a *new* model. safetensors maps the file lazily, so no weight byte is read
  back and no serving model holds the new weights when the clock stops: it only measures the write.

The replica double-buffers: the engine adopts the staged buffers as its weights (no copy) and the
buffers they replace become the staging buffers of the next push. So the first *two* pushes into a
fresh replica write fresh memory and pay its page faults (on a VM, first-touch faults cost more
than the copy); they are reported separately ("cold") and the median of the following pushes is
the steady state a training run sees. Prints GB/s for each (1 GB = 1e9 bytes of weights) and
the ratios.

Usage: ``python bench/weights.py [--quick] [--size bench] [--repeats 5] [--bucket-mib 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.process import free_port  # noqa: E402
from services.rollout.weights.bucketing import DEFAULT_BUCKET_BYTES  # noqa: E402

TOKEN = "bench-weight-token"


def _wait_replica(target: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import grpc

    from services.rollout.weights.client import get_version

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            asyncio.run(get_version(target, timeout_s=2))
            return
        except grpc.aio.AioRpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the replica process did not start") from None
            time.sleep(0.5)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _disk_into_serving(model: Any, serving: Any, ckpt: Path, fsync: bool) -> None:
    """The honest baseline: write a checkpoint, then reload it into the resident serving model."""
    from safetensors.torch import load_file

    model.save_pretrained(ckpt)
    if fsync:
        _fsync_dir(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"save_pretrained wrote no *.safetensors into {ckpt}")
    loaded: set[str] = set()
    for f in files:
        state = load_file(f)
        serving.load_state_dict(state, strict=False)
        loaded.update(state)
    names = set(serving.state_dict())
    if serving.config.tie_word_embeddings:  # save_pretrained drops the tied alias
        names -= {k for k in names if k.startswith("lm_head.")}
    missing = names - loaded
    if missing:
        raise RuntimeError(f"the checkpoint misses weights of the serving model: {sorted(missing)[:3]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, one repeat (a smoke run)")
    ap.add_argument("--size", default="bench", help="model preset (bench is ~526 MB fp32)")
    ap.add_argument("--repeats", type=int, default=5, help="warm pushes and disk round trips (median)")
    ap.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / (1 << 20),
                    help="message size in MiB (default: the client's default)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--replica", choices=("rollout", "bare"), default="rollout",
                    help="rollout: `retool rollout serve`; bare: python -m services.rollout.weights.server")
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats = "small", 1
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.rollout.model_init import init_model_dir
    from services.rollout.weights.client import (
        get_version,
        iter_checkpoint,
        push_state_dict,
        push_state_dict_shm,
    )

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    hf_logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    try:
        t0 = time.perf_counter()
        served = init_model_dir(work / "served", args.size, seed=0)  # what the replica starts with
        pushed = init_model_dir(work / "pushed", args.size, seed=1)  # what the trainer pushes
        print(f"built two {args.size} models in {time.perf_counter() - t0:.1f}s", flush=True)
        state = dict(iter_checkpoint(pushed))  # the trainer's in-memory weights
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(f"payload: {len(state)} tensors, {nbytes / 1e6:.0f} MB", flush=True)

        port = free_port()
        target = f"127.0.0.1:{port}"
        env = {**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN}
        if args.replica == "rollout":  # the real service: retool rollout serve (HTTP + gRPC)
            cmd = ["-m", "services.cli", "rollout", "serve", "--model", str(served), "--grpc-port", str(port),
                   "--port", str(free_port())]
        else:
            cmd = ["-m", "services.rollout.weights.server", "--model", str(served), "--port", str(port)]
        proc = subprocess.Popen([sys.executable, *cmd], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        print(f"replica: {args.replica} ({' '.join(cmd[:4])} ...)", flush=True)
        try:
            _wait_replica(target, proc)
            push_s, loads = [], []
            cold = []
            for i in range(2):  # both buffer sets are fresh memory
                cold.append(push_state_dict(state.items(), [target], version=100 + i, token=TOKEN,
                                            bucket_bytes=int(args.bucket_mib * (1 << 20))))
                print(f"  cold push {i + 1} (fresh staging buffers): {cold[-1].seconds:.2f}s = "
                      f"{cold[-1].gbps:.2f} GB/s", flush=True)
            for i in range(args.repeats):
                rep = push_state_dict(state.items(), [target], version=i + 1, token=TOKEN,
                                      bucket_bytes=int(args.bucket_mib * (1 << 20)))
                assert asyncio.run(get_version(target)) == i + 1
                push_s.append(rep.seconds)
                loads.append(rep.replies[target]["load_seconds"])
                print(f"  push {i + 1}: {rep.seconds:.2f}s = {rep.gbps:.2f} GB/s "
                      f"(of which engine load {loads[-1]:.2f}s)", flush=True)
            shm_cold, shm_s, shm_loads = [], [], []
            for i in range(2):  # first write into each segment's mapping in this process
                rep = push_state_dict_shm(state.items(), target, version=200 + i, token=TOKEN)
                shm_cold.append(rep.seconds)
                what = "creates the segments" if i == 0 else "segment 1"
                print(f"  cold shm push {i + 1} ({what}): {rep.seconds:.3f}s = {rep.gbps:.2f} GB/s",
                      flush=True)
            for i in range(args.repeats):
                rep = push_state_dict_shm(state.items(), target, version=300 + i, token=TOKEN)
                assert asyncio.run(get_version(target)) == 300 + i
                assert rep.bytes == nbytes, (rep.bytes, nbytes)
                shm_s.append(rep.seconds)
                shm_loads.append(rep.replies[target]["load_seconds"])
                print(f"  shm push {i + 1}: {rep.seconds:.3f}s = {rep.gbps:.2f} GB/s "
                      f"(of which commit/adopt {shm_loads[-1]:.3f}s)", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)

        model = AutoModelForCausalLM.from_pretrained(pushed)  # the trainer's model
        serving = AutoModelForCausalLM.from_pretrained(served)  # the resident serving model
        with torch.no_grad():  # private, touched memory (not the file's lazy mapping)
            for p in serving.parameters():
                p.data = p.data.clone()
        disk_s, durable_s, lazy_s = [], [], []
        for i in range(args.repeats):
            ckpt = work / f"ckpt{i}"
            for fsync, times in ((False, disk_s), (True, durable_s)):
                t0 = time.perf_counter()
                _disk_into_serving(model, serving, ckpt, fsync)
                times.append(time.perf_counter() - t0)
                shutil.rmtree(ckpt)
            with torch.no_grad():
                assert all(torch.equal(a, b) for a, b in zip(model.parameters(), serving.parameters(),
                                                            strict=True))
            t0 = time.perf_counter()
            model.save_pretrained(ckpt)
            reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
            lazy_s.append(time.perf_counter() - t0)
            del reloaded
            shutil.rmtree(ckpt)
            print(f"  disk {i + 1}: -> serving model {disk_s[-1]:.2f}s = {nbytes / 1e9 / disk_s[-1]:.2f} "
                  f"GB/s; + fsync {durable_s[-1]:.2f}s = {nbytes / 1e9 / durable_s[-1]:.2f} GB/s; lazy "
                  f"from_pretrained {lazy_s[-1]:.2f}s = {nbytes / 1e9 / lazy_s[-1]:.2f} GB/s", flush=True)

        push_med, disk_med = statistics.median(push_s), statistics.median(disk_s)
        shm_med = statistics.median(shm_s)
        durable_med, lazy_med = statistics.median(durable_s), statistics.median(lazy_s)

        def gbps(seconds: float) -> float:
            return round(nbytes / 1e9 / seconds, 3)

        result = {
            "size": args.size, "replica": args.replica, "bytes": nbytes, "repeats": args.repeats,
            "bucket_mib": args.bucket_mib,
            "push_seconds_median": round(push_med, 3), "push_gbps": gbps(push_med),
            "engine_load_seconds_median": round(statistics.median(loads), 3),
            "cold_push_seconds": [round(c.seconds, 3) for c in cold],
            "disk_seconds_median": round(disk_med, 3), "disk_gbps": gbps(disk_med),
            "speedup_vs_disk": round(disk_med / push_med, 2),
            "durable_disk_seconds_median": round(durable_med, 3), "durable_disk_gbps": gbps(durable_med),
            "speedup_vs_durable_disk": round(durable_med / push_med, 2),
            "lazy_disk_seconds_median": round(lazy_med, 3), "lazy_disk_gbps": gbps(lazy_med),
            "speedup_vs_lazy_disk": round(lazy_med / push_med, 2),
            "shm_push_seconds_median": round(shm_med, 4), "shm_push_gbps": gbps(shm_med),
            "shm_commit_seconds_median": round(statistics.median(shm_loads), 4),
            "shm_cold_push_seconds": [round(c, 3) for c in shm_cold],
            "shm_speedup_vs_disk": round(disk_med / shm_med, 2),
            "shm_speedup_vs_durable_disk": round(durable_med / shm_med, 2),
        }
        rows = [("gRPC push (received + loaded)", push_med),
                ("gRPC-controlled shared memory (colocated)", shm_med),
                ("disk -> serving model", disk_med),
                ("disk + fsync -> serving model", durable_med),
                ("lazy from_pretrained (not honest)", lazy_med)]
        print(f"\n{'method':<43}{'seconds':>9}{'GB/s':>8}{'push speedup':>14}{'vs disk':>9}")
        for label, sec in rows:
            print(f"{label:<43}{sec:>9.3f}{gbps(sec):>8.2f}{sec / push_med:>13.2f}x{disk_med / sec:>8.2f}x")
        print(f"targets: push >= 1 GB/s ({result['push_gbps']:.2f}), >= 2x the honest disk baseline "
              f"({result['speedup_vs_disk']:.2f}x; {result['speedup_vs_durable_disk']:.2f}x with fsync)")
        print(f"colocated shared memory: {result['shm_push_gbps']:.2f} GB/s, "
              f"{result['shm_speedup_vs_disk']:.2f}x the honest disk baseline "
              f"({result['shm_speedup_vs_durable_disk']:.2f}x with fsync)")
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

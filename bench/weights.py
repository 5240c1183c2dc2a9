"""Weight-push benchmark: gRPC push into a running replica process vs a disk checkpoint round trip.

Ours: the trainer holds a state dict in memory and streams it over gRPC on loopback to a rollout
replica running as a separate process (``retool rollout serve --grpc-port``, or with
``--replica bare`` just an HF engine + the weight-push server), which stages it and loads it into
the engine; the clock stops when the replica answers, i.e. after the weights are *received and
loaded*.
Baselines, in the bench process itself (no process hop, which flatters them):
- "disk": ``save_pretrained`` of the same model + ``from_pretrained`` back (the usual "write a
  checkpoint, the rollout reloads it" cycle). Both ends are served by the page cache and
  ``from_pretrained`` maps the safetensors lazily, so no weight byte is actually read back;
- "durable disk": the same, plus ``fsync`` of the files (a checkpoint really on disk) and a read
  of every weight after reloading (the bytes the engine would serve).

The first push into a fresh replica also pays for page faults (staging buffers are allocated,
the engine's mmapped weights become private pages); it is reported separately ("cold") and the
median of the following pushes is the steady state a training run sees. Prints GB/s for each
(1 GB = 1e9 bytes of weights) and the ratios.

Usage: ``python bench/weights.py [--quick] [--size bench] [--repeats 3] [--bucket-mib 4]``
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.process import free_port  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, one repeat (a smoke run)")
    ap.add_argument("--size", default="bench", help="model preset (bench is ~526 MB fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=float, default=4.0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--replica", choices=("rollout", "bare"), default="rollout",
                    help="rollout: `retool rollout serve`; bare: python -m services.rollout.weights.server")
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats = "small", 1

    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.model_init import init_model_dir
    from services.rollout.weights.client import get_version, iter_checkpoint, push_state_dict

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
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
            cold = push_state_dict(state.items(), [target], version=100, token=TOKEN,
                                   bucket_bytes=int(args.bucket_mib * (1 << 20)))
            print(f"  cold push (fresh staging buffers and engine pages): {cold.seconds:.2f}s = "
                  f"{cold.gbps:.2f} GB/s", flush=True)
            for i in range(args.repeats):
                rep = push_state_dict(state.items(), [target], version=i + 1, token=TOKEN,
                                      bucket_bytes=int(args.bucket_mib * (1 << 20)))
                assert asyncio.run(get_version(target)) == i + 1
                push_s.append(rep.seconds)
                loads.append(rep.replies[target]["load_seconds"])
                print(f"  push {i + 1}: {rep.seconds:.2f}s = {rep.gbps:.2f} GB/s "
                      f"(of which engine load {loads[-1]:.2f}s)", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)

        model = AutoModelForCausalLM.from_pretrained(pushed)
        disk_s, durable_s = [], []
        for i in range(args.repeats):
            ckpt = work / f"ckpt{i}"
            t0 = time.perf_counter()
            model.save_pretrained(ckpt)
            reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
            disk_s.append(time.perf_counter() - t0)
            del reloaded
            shutil.rmtree(ckpt)
            t0 = time.perf_counter()
            model.save_pretrained(ckpt)
            _fsync_dir(ckpt)
            reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
            with torch.no_grad():  # make sure every weight was really read back
                checksum = sum(float(p.sum()) for p in reloaded.parameters())
            durable_s.append(time.perf_counter() - t0)
            assert checksum == checksum  # not NaN
            del reloaded
            shutil.rmtree(ckpt)
            print(f"  disk {i + 1}: {disk_s[-1]:.2f}s = {nbytes / 1e9 / disk_s[-1]:.2f} GB/s; durable "
                  f"{durable_s[-1]:.2f}s = {nbytes / 1e9 / durable_s[-1]:.2f} GB/s", flush=True)

        push_med, disk_med = statistics.median(push_s), statistics.median(disk_s)
        durable_med = statistics.median(durable_s)
        result = {
            "size": args.size, "replica": args.replica, "bytes": nbytes, "repeats": args.repeats,
            "bucket_mib": args.bucket_mib,
            "push_seconds_median": round(push_med, 3), "push_gbps": round(nbytes / 1e9 / push_med, 3),
            "engine_load_seconds_median": round(statistics.median(loads), 3),
            "cold_push_seconds": round(cold.seconds, 3),
            "disk_seconds_median": round(disk_med, 3), "disk_gbps": round(nbytes / 1e9 / disk_med, 3),
            "speedup_vs_disk": round(disk_med / push_med, 2),
            "durable_disk_seconds_median": round(durable_med, 3),
            "durable_disk_gbps": round(nbytes / 1e9 / durable_med, 3),
            "speedup_vs_durable_disk": round(durable_med / push_med, 2),
        }
        print(f"\n{'method':<34}{'seconds':>9}{'GB/s':>8}")
        print(f"{'gRPC push (received + loaded)':<34}{push_med:>9.2f}{result['push_gbps']:>8.2f}")
        print(f"{'disk save_pretrained+from_pretrained':<34}{disk_med:>9.2f}{result['disk_gbps']:>8.2f}")
        durable_gbps = result["durable_disk_gbps"]
        print(f"{'disk + fsync + read every weight':<34}{durable_med:>9.2f}{durable_gbps:>8.2f}")
        print(f"speedup vs disk: {result['speedup_vs_disk']:.2f}x, vs durable disk: "
              f"{result['speedup_vs_durable_disk']:.2f}x   (targets: >= 1 GB/s, >= 2x)")
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

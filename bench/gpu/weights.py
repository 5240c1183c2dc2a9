"""Section 5, weights: delta encoding next to the master weights vs on the host, then full and delta
pushes into a local replica vs the disk round trip.

The master weights are fp32 on the device after real AdamW steps at lr 1e-6 (``bench/weights.py``'s
setting); the replica (a separate process: HF engine + weight server, bf16, CPU) serves bf16, so
every method includes the cast. Every timed delta is one real optimizer step's change.
1. encode, per arm (median of ``weights_repeats``): ``host`` (numpy, what the trainer runs today)
   from a CPU copy of the master, ``host`` straight from the device master (chunks copied over one by
   one), ``device`` (torch compare on the master's device, ``DeltaEncoder(where="device")``), and the
   device→host copy of the whole fp32 master (what ``full_state_dict`` costs before a host encode).
   All arms must produce the same payload bytes.
2. push: full gRPC push, delta push with the host encoder (CPU master, as the trainer does) and with
   the device encoder (device master), against the faster disk round trip (save_pretrained fp32 or
   bf16, then load into a resident bf16 model). ``from_master`` adds the device→host copy to every
   method that needs the master on the host, so the ratios compare whole paths from the GPU's weights;
   the issue's target is delta >= 2x the disk round trip.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from typing import Any

from bench.gpu.common import Ctx, sync

TARGET_VS_DISK = 2.0


def _encode_arm(states: list[dict[str, Any]], dtype: Any, where: str, reps: int) -> dict[str, Any]:
    from services.transport.weights.delta import DeltaEncoder

    enc = DeltaEncoder(dtype, threads=2, where=where)  # type: ignore[arg-type]
    try:
        enc.update(states[0].items(), 1)  # the first version: a full push, no compare
        seconds, payload, changed = [], 0, 0
        for i in range(reps):
            state = states[1] if i % 2 == 0 else states[0]
            sync_all(state)
            t0 = time.perf_counter()
            delta = enc.update(state.items(), i + 2)
            seconds.append(time.perf_counter() - t0)
            assert delta is not None
            if i == 0:
                payload, changed = delta.payload_bytes, delta.changed
        return {
            "median_seconds": statistics.median(seconds),
            "seconds": seconds,
            "payload_bytes": payload,
            "changed": changed,
        }
    finally:
        enc.close()


def sync_all(state: dict[str, Any]) -> None:
    t = next(iter(state.values()))
    sync(t.device.type)


def _d2h(state: dict[str, Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        sync_all(state)
        t0 = time.perf_counter()
        {n: t.cpu() for n, t in state.items()}
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _pushes(
    target: str, states: list[dict[str, Any]], delta: str, where: str, first: int, n: int
) -> list[dict[str, float]]:
    from bench.weights import TOKEN
    from services.trainer.push import WeightPusher
    from services.transport.weights.bucketing import DEFAULT_BUCKET_BYTES

    pusher = WeightPusher(
        [target],
        TOKEN,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        delta=delta,  # type: ignore[arg-type]
        backoff_s=0,
        encode_where=where,
    )  # type: ignore[arg-type]
    try:
        return [await pusher.push(states[i % 2], first + i) for i in range(n)]
    finally:
        pusher.close()


def run(ctx: Ctx) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from bench.weights import _disk_into_serving, _train, _wait_replica, start_replica
    from services.models.tiny import init_model_dir

    hf_logging.disable_progress_bar()
    sizes, dev, reps = ctx.sizes, ctx.device, ctx.sizes.weights_repeats
    served = init_model_dir(ctx.work / "weights-model", sizes.weights_preset, seed=0)  # type: ignore[arg-type]
    target, proc = start_replica(served)  # it loads while the master weights train
    try:
        model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).to(dev)
        nparams = sum(p.numel() for p in model.parameters())
        states = _train(model, 3, 1e-6)[-2:]  # two consecutive real steps, on the device
        host_states = [{n: t.cpu() for n, t in s.items()} for s in states]
        ctx.save(
            preset=sizes.weights_preset, parameters=nparams, full_bf16_bytes=nparams * 2, master_device=dev
        )
        bf16 = torch.bfloat16
        encode = {"host, CPU master": _encode_arm(host_states, bf16, "host", reps)}
        if dev != "cpu":
            encode["host, device master"] = _encode_arm(states, bf16, "host", reps)
        encode[f"device ({dev}), device master"] = _encode_arm(states, bf16, "device", reps)
        d2h = _d2h(states[1], reps) if dev != "cpu" else 0.0
        same = len({(a["payload_bytes"], a["changed"]) for a in encode.values()}) == 1
        ctx.save(
            encode=encode,
            d2h_fp32_seconds=d2h,
            encode_payloads_identical=same,
            density=encode["host, CPU master"]["changed"] / nparams,
        )

        _wait_replica(target, proc)
        full = asyncio.run(_pushes(target, host_states, "off", "host", 100, 2 + reps))[2:]  # 2 cold pushes
        delta_host = asyncio.run(_pushes(target, host_states, "auto", "host", 200, 1 + reps))[1:]
        delta_dev = asyncio.run(_pushes(target, states, "auto", "device", 300, 1 + reps))[1:]
        for m in delta_host + delta_dev:
            if m["weights/push_delta_targets"] != 1:
                raise RuntimeError(f"a timed push was not a delta: {m}")
        med = statistics.median
        push = {
            "full_grpc_seconds": med([m["weights/push_seconds"] for m in full]),
            "delta_host_seconds": med([m["weights/push_seconds"] for m in delta_host]),
            "delta_device_seconds": med([m["weights/push_seconds"] for m in delta_dev]),
            "delta_wire_bytes": med([m["weights/push_wire_bytes"] for m in delta_dev]),
        }
        ctx.save(push=push)

        serving = AutoModelForCausalLM.from_pretrained(served, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in serving.parameters():
                p.data = p.data.clone()
        disk: dict[str, list[float]] = {"fp32": [], "bf16": []}
        for i in range(reps):
            for kind in disk:
                ckpt = ctx.work / f"ckpt-{i}-{kind}"
                t0 = time.perf_counter()
                _disk_into_serving(host_states[1], model, serving, ckpt, kind == "bf16")
                disk[kind].append(time.perf_counter() - t0)
                shutil.rmtree(ckpt)
        disk_s = min(med(disk["fp32"]), med(disk["bf16"]))
        # whole paths from the master weights where they live (the device→host copy where one is needed)
        from_master = {
            "disk": d2h + disk_s,
            "full_grpc": d2h + push["full_grpc_seconds"],
            "delta_host": d2h + push["delta_host_seconds"],
            "delta_device": push["delta_device_seconds"],
        }
        best_delta = min(from_master["delta_host"], from_master["delta_device"])
        ctx.save(
            disk={
                "fp32_seconds": med(disk["fp32"]),
                "bf16_seconds": med(disk["bf16"]),
                "best_seconds": disk_s,
            },
            from_master=from_master,
            delta_vs_disk=from_master["disk"] / best_delta,
            full_vs_disk=from_master["disk"] / from_master["full_grpc"],
            target_vs_disk=TARGET_VS_DISK,
            target_met=from_master["disk"] / best_delta >= TARGET_VS_DISK,
            faster_encoder="device" if from_master["delta_device"] < from_master["delta_host"] else "host",
        )
    finally:
        proc.terminate()
        proc.wait(30)

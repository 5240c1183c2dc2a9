"""Weight-push benchmark: full gRPC, delta gRPC, shared memory and the disk round trip, in one run.

Setting (issue 17): the trainer holds **fp32 master weights** of the ``bench`` preset (~526 MB fp32,
~263 MB bf16) after real AdamW steps at ``--lr`` (default 1e-6) on real gradients (language-model
loss on random tokens); the rollout replica is a separate process (``python -m
services.rollout.weights.server --dtype bfloat16``: the HF engine + the weight-push server) that
**serves bf16**. Every method starts from the fp32 master weights in the trainer's memory and
ends when the replica serves the new weights, so each includes the cast to bf16:
- "full gRPC": ``WeightPusher(delta="off")``: cast + the whole bf16 state streamed and adopted;
- "delta gRPC": ``WeightPusher(delta="auto")``: cast + compare with the last pushed version (the
  shadow) + only the changed elements (SPARSE: uint32 index + bf16 value) streamed and written
  into the served tensors. Each timed push is one real optimizer step's change (the pushes
  alternate between the weights after step n and step n+1, so every delta is one step);
- "shm": ``push_state_dict_shm`` of the bf16 cast (colocated only: same machine, uid, /dev/shm);
- disk baselines, in the bench process (no process hop, which flatters them), into a resident
  bf16 serving model: "disk (fp32 save_pretrained)" writes the trainer's fp32 model
  (``save_pretrained``, page cache, no fsync), then ``load_file`` + ``load_state_dict`` into the
  serving model; "disk (bf16 save_pretrained)" casts to bf16 first and saves that (half the bytes:
  the stronger baseline; the targets are judged against the faster of the two).
It also measures, on the same real step, the candidate delta encodings (bytes and encode/decode
seconds): SPARSE (what the protocol uses), XOR of the bit patterns + zstd / lz4, and SPARSE with
delta-coded indices + zstd (when ``zstandard`` / ``lz4`` are installed: ``pip install zstandard lz4``).
Finally it checks bit-identity: an in-process replica that got a full push and then a chain of
deltas serves exactly the cast of the master weights.

Cold pushes (fresh staging buffers / segments) are reported separately; medians of ``--repeats``.
Usage: ``python bench/weights.py [--quick] [--size bench] [--repeats 5] [--lr 1e-6] [--steps 3]``
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
from services.transport.weights.bucketing import DEFAULT_BUCKET_BYTES  # noqa: E402

TOKEN = "bench-weight-token"


def _wait_replica(target: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import grpc

    from services.transport.weights.client import get_version

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            asyncio.run(get_version(target, timeout_s=2))
            return
        except grpc.aio.AioRpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the replica process did not start") from None
            time.sleep(0.5)


def start_replica(served: Path, dtype: str = "bfloat16") -> tuple[str, subprocess.Popen]:
    """A bare replica process (the HF engine on the CPU + the weight-push server); wait with
    ``_wait_replica``."""
    port = free_port()
    env = {**os.environ, "RETOOL_WEIGHT_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "services.rollout.weights.server", "--model", str(served),
           "--port", str(port), "--dtype", dtype]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"127.0.0.1:{port}", proc


def _train(model: Any, steps: int, lr: float, seed: int = 0) -> list[dict[str, Any]]:
    """Real AdamW steps on random tokens; the fp32 master weights after each of them (on the model's
    device)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    states = []
    for i in range(steps):
        t0 = time.perf_counter()
        ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=gen).to(model.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
        print(f"  AdamW step {i + 1}/{steps} (lr {lr:g}): loss {loss.item():.4f}, "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    return states


def _disk_into_serving(state: dict[str, Any], model: Any, serving: Any, ckpt: Path, bf16: bool) -> None:
    """The baseline: write a checkpoint of the master weights, reload it into the serving model."""
    import torch
    from safetensors.torch import load_file

    if bf16:
        model.save_pretrained(ckpt, state_dict={n: t.to(torch.bfloat16) for n, t in state.items()})
    else:
        model.save_pretrained(ckpt, state_dict=state)
    loaded: set[str] = set()
    for f in sorted(ckpt.glob("*.safetensors")):
        part = load_file(f)
        serving.load_state_dict(part, strict=False)
        loaded.update(part)
    missing = set(state) - loaded
    if missing:
        raise RuntimeError(f"the checkpoint misses weights: {sorted(missing)[:3]}")


def _encodings(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Bytes and seconds of candidate delta encodings of one real step (bf16 bit patterns)."""
    import numpy as np

    from services.transport.weights.delta import int_view

    pairs = [(int_view(old[n]), int_view(new[n])) for n in new]
    total = sum(a.nbytes for a, _ in pairs)
    candidates: dict[str, tuple[Any, Any]] = {}

    def sparse_enc(a: Any, b: Any) -> list[bytes]:
        idx = np.flatnonzero(a != b)
        return [idx.astype("<u4").tobytes(), b[idx].tobytes()]

    def sparse_dec(buf: Any, blob: list[bytes]) -> None:
        buf[np.frombuffer(blob[0], "<u4")] = np.frombuffer(blob[1], buf.dtype)

    candidates["SPARSE (uint32 index + value)"] = (sparse_enc, sparse_dec)
    try:
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        candidates["XOR + zstd-1"] = (lambda a, b: [zc.compress((a ^ b).tobytes())],
                                      lambda buf, blob: buf.__ixor__(np.frombuffer(zd.decompress(blob[0]),
                                                                                   buf.dtype)))

        def gaps_enc(a: Any, b: Any) -> list[bytes]:
            idx = np.flatnonzero(a != b)
            gaps = np.diff(idx, prepend=0).astype("<u4").view(np.uint8).reshape(-1, 4).T.copy()
            return [zc.compress(gaps.tobytes()), zc.compress(b[idx].tobytes())]

        def gaps_dec(buf: Any, blob: list[bytes]) -> None:
            g = np.frombuffer(zd.decompress(blob[0]), np.uint8).reshape(4, -1).T.copy()
            g = g.view("<u4").reshape(-1)
            buf[np.cumsum(g, dtype=np.int64)] = np.frombuffer(zd.decompress(blob[1]), buf.dtype)

        candidates["SPARSE, index gaps shuffled + zstd-1"] = (gaps_enc, gaps_dec)
    except ImportError:
        print("  (zstandard not installed: XOR+zstd not measured)")
    try:
        import lz4.block

        candidates["XOR + lz4"] = (lambda a, b: [lz4.block.compress((a ^ b).tobytes())],
                                   lambda buf, blob: buf.__ixor__(np.frombuffer(lz4.block.decompress(blob[0]),
                                                                                buf.dtype)))
    except ImportError:
        print("  (lz4 not installed: XOR+lz4 not measured)")
    rows = []
    for label, (enc, dec) in candidates.items():
        size = enc_s = dec_s = 0.0
        for a, b in pairs:
            t0 = time.perf_counter()
            blob = enc(a, b)
            enc_s += time.perf_counter() - t0
            size += sum(len(x) for x in blob)
            buf = a.copy()
            t0 = time.perf_counter()
            dec(buf, blob)
            dec_s += time.perf_counter() - t0
            if not np.array_equal(buf, b):
                raise AssertionError(f"{label} does not round-trip")
        rows.append({"encoding": label, "bytes": int(size), "fraction_of_full": round(size / total, 4),
                     "encode_s": round(enc_s, 3), "decode_s": round(dec_s, 3)})
    return rows


async def _bit_identity(served_dir: Path, states: list[dict[str, Any]]) -> bool:
    """A full push then deltas into an in-process bf16 replica: it serves exactly the cast master."""
    import torch

    from services.rollout.engine.hf import HFEngine
    from services.rollout.weights.server import start_weight_server
    from services.trainer.push import WeightPusher

    engine = HFEngine(served_dir, dtype="bfloat16")
    server = await start_weight_server(engine, "127.0.0.1", 0, TOKEN)
    pusher = WeightPusher([f"127.0.0.1:{server.port}"], TOKEN, bucket_bytes=DEFAULT_BUCKET_BYTES, backoff_s=0)
    try:
        kinds = []
        for v, state in enumerate(states, start=1):
            m = await pusher.push(state, v)
            kinds.append("delta" if m["weights/push_delta_targets"] else "full")
        live = dict(engine.model.named_parameters())
        same = all(torch.equal(live[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))
                   for n, t in states[-1].items())
        print(f"  bit-identity: pushes {kinds} -> replica == cast(master): {same}", flush=True)
        return same and kinds[1:] == ["delta"] * (len(kinds) - 1)
    finally:
        pusher.close()
        await server.stop(None)
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, one repeat (a smoke run)")
    ap.add_argument("--size", default="bench", help="model preset (bench is ~526 MB fp32)")
    ap.add_argument("--repeats", type=int, default=5, help="timed pushes / round trips per method (median)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the real steps")
    ap.add_argument("--steps", type=int, default=3, help="real AdamW steps (>= 2)")
    ap.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / (1 << 20))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats, args.steps = "small", 1, 2
    if args.repeats < 1 or args.steps < 2:
        ap.error("--repeats must be >= 1 and --steps >= 2")

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.models.tiny import init_model_dir
    from services.trainer.push import WeightPusher
    from services.transport.weights.client import get_replica_state, push_state_dict_shm

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    hf_logging.disable_progress_bar()
    bucket = int(args.bucket_mib * (1 << 20))
    work = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    try:
        served = init_model_dir(work / "served", args.size, seed=0)
        model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)  # the trainer's model
        nparams = sum(p.numel() for p in model.parameters())
        print(f"model: {args.size}, {nparams / 1e6:.1f}M parameters = {nparams * 4 / 1e6:.0f} MB fp32 "
              f"master, {nparams * 2 / 1e6:.0f} MB bf16 served", flush=True)
        states = _train(model, args.steps, args.lr)
        a, b = states[-2], states[-1]  # two consecutive real steps
        bf16 = {n: t.to(torch.bfloat16) for n, t in b.items()}
        full_bytes = nparams * 2

        target, proc = start_replica(served)
        res: dict[str, Any] = {"size": args.size, "params": nparams, "lr": args.lr, "repeats": args.repeats,
                               "full_bf16_bytes": full_bytes}
        try:
            _wait_replica(target, proc)
            assert asyncio.run(get_replica_state(target)).serving_dtype == "bfloat16"

            async def pushes(delta: str, first_version: int, n: int) -> list[dict[str, float]]:
                pusher = WeightPusher([target], TOKEN, bucket_bytes=bucket, delta=delta, backoff_s=0)  # type: ignore[arg-type]
                try:
                    return [await pusher.push(a if i % 2 == 0 else b, first_version + i) for i in range(n)]
                finally:
                    pusher.close()

            full = asyncio.run(pushes("off", 100, 2 + args.repeats))
            for i, m in enumerate(full):
                print(f"  full gRPC push {i + 1}{' (cold)' if i < 2 else ''}: "
                      f"{m['weights/push_seconds']:.3f}s ({m['weights/push_wire_bytes'] / 1e6:.0f} MB; "
                      f"load {m['weights/push_load_seconds']:.3f}s)", flush=True)
            delta = asyncio.run(pushes("auto", 200, 1 + args.repeats))
            for i, m in enumerate(delta):
                print(f"  delta gRPC push {i + 1}{' (full: no base yet)' if i == 0 else ''}: "
                      f"{m['weights/push_seconds']:.3f}s ({m['weights/push_wire_bytes'] / 1e6:.1f} MB, "
                      f"density {m['weights/push_density']:.4f}; encode "
                      f"{m['weights/push_encode_seconds']:.3f}s, wire {m['weights/push_wire_seconds']:.3f}s, "
                      f"load {m['weights/push_load_seconds']:.3f}s)", flush=True)
            deltas = delta[1:]
            assert all(m["weights/push_delta_targets"] == 1 for m in deltas), "a timed push was not a delta"
            shm_s = []
            for i in range(2 + args.repeats):
                t0 = time.perf_counter()
                rep = push_state_dict_shm(((n, t.to(torch.bfloat16)) for n, t in b.items()), target, 300 + i,
                                          TOKEN)
                shm_s.append(time.perf_counter() - t0)
                assert rep.bytes == full_bytes
                print(f"  shm push {i + 1}{' (cold)' if i < 2 else ''}: {shm_s[-1]:.3f}s", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)

        serving = AutoModelForCausalLM.from_pretrained(served, dtype=torch.bfloat16)
        with torch.no_grad():  # private, touched memory (not the file's lazy mapping)
            for p in serving.parameters():
                p.data = p.data.clone()
        disk: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats):
            for cast in (False, True):
                ckpt = work / f"ckpt{i}{cast}"
                t0 = time.perf_counter()
                _disk_into_serving(b, model, serving, ckpt, cast)
                disk[cast].append(time.perf_counter() - t0)
                shutil.rmtree(ckpt)
            print(f"  disk {i + 1}: fp32 save_pretrained -> serving {disk[False][-1]:.3f}s; "
                  f"bf16 save_pretrained -> serving {disk[True][-1]:.3f}s", flush=True)
        live = dict(serving.named_parameters())
        assert all(torch.equal(live[n], t) for n, t in bf16.items()), "the disk baseline lost bits"

        print("  delta encodings of one real step:", flush=True)
        enc_rows = _encodings({n: t.to(torch.bfloat16) for n, t in a.items()}, bf16)
        for r in enc_rows:
            print(f"    {r['encoding']:<40}{r['bytes'] / 1e6:8.2f} MB ({100 * r['fraction_of_full']:.2f}% of "
                  f"full)  encode {r['encode_s']:.3f}s  decode {r['decode_s']:.3f}s", flush=True)
        identical = asyncio.run(_bit_identity(served, states))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    full_s = med([m["weights/push_seconds"] for m in full[2:]])
    delta_s = med([m["weights/push_seconds"] for m in deltas])
    shm_med = med(shm_s[2:])
    disk32, disk16 = med(disk[False]), med(disk[True])
    best_disk = min(disk32, disk16)
    wire = med([m["weights/push_wire_bytes"] for m in deltas])
    density = med([m["weights/push_density"] for m in deltas])
    res.update({
        "full_push_seconds": round(full_s, 4), "delta_push_seconds": round(delta_s, 4),
        "shm_push_seconds": round(shm_med, 4), "disk_fp32_seconds": round(disk32, 4),
        "disk_bf16_seconds": round(disk16, 4),
        "delta_encode_seconds": round(med([m["weights/push_encode_seconds"] for m in deltas]), 4),
        "delta_wire_seconds": round(med([m["weights/push_wire_seconds"] for m in deltas]), 4),
        "delta_load_seconds": round(med([m["weights/push_load_seconds"] for m in deltas]), 4),
        "delta_wire_bytes": int(wire), "delta_wire_fraction": round(wire / full_bytes, 4),
        "delta_density": round(density, 5), "delta_speedup_vs_best_disk": round(best_disk / delta_s, 2),
        "delta_speedup_vs_fp32_disk": round(disk32 / delta_s, 2), "bit_identical": identical,
        "encodings": enc_rows,
    })
    rows = [("full gRPC push (bf16)", full_s, full_bytes), ("delta gRPC push (SPARSE)", delta_s, wire),
            ("shm (colocated)", shm_med, full_bytes),
            ("disk: fp32 save_pretrained + reload", disk32, 2 * full_bytes),
            ("disk: bf16 save_pretrained + reload", disk16, full_bytes)]
    print(f"\n{'method (fp32 master -> bf16 served)':<40}{'seconds':>9}{'MB moved':>10}{'vs best disk':>14}"
          f"{'vs full push':>14}")
    for label, sec, nbytes in rows:
        print(f"{label:<40}{sec:>9.3f}{nbytes / 1e6:>10.1f}{best_disk / sec:>13.2f}x{full_s / sec:>13.2f}x")
    print(f"delta: density {density:.4f}, wire bytes {100 * wire / full_bytes:.2f}% of a full bf16 push; "
          f"targets: >= 2x the disk baseline ({res['delta_speedup_vs_best_disk']:.2f}x the faster one, "
          f"{res['delta_speedup_vs_fp32_disk']:.2f}x fp32 save_pretrained), <= 10% wire bytes, bit-identical "
          f"({identical})")
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

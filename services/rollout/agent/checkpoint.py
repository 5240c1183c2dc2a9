"""Turn checkpoints: a sample's state in Redis at each turn boundary, so another replica continues it.

A turn boundary is the point after the interpreter's output was appended, or after a weight swap:
an engine swaps weights between two tokens of a turn, and the loop checkpoints the turn so far at
the first chunk boundary after the swap that does not cut a stop string (``loop.py``). Such a
mid-turn checkpoint records where its open turn started (``turn_start``), so that the sample that
continues it parses the whole turn's tool call; a meta without ``turn_start`` (written before the
field existed) is at a turn boundary.

Layout: one Redis hash per job, ``<prompts stream>:ckpt:<job_id>``, with a TTL (``checkpoint_ttl_s``,
refreshed by every write) so the state of an abandoned job expires. Per sample ``i``:
- ``<i>:<writer>:<k>``: segment ``k`` of writer ``writer`` (a random id per job attempt): the tokens
  added since the writer's previous checkpoint of that sample, in the wire's compact encoding
  (``group_wire``: packed ids, run-length versions, float32 log-probs of the generated tokens only;
  the loss mask is implied by version -1) plus the sandbox session cells run since then;
- ``m<i>``: the sample's meta (msgpack): the segment field names in order, the length they hold,
  the turn and tool counters, for a mid-turn checkpoint the response offset where its open turn
  started (``turn_start``; absent or nil at a turn boundary), and for a finished sample its finish
  reason;
- ``p<i>``: the sample's response length as last reported by the worker's heartbeat.

Invariants:
- A sample does not wait for its checkpoint's round trip: ``save`` encodes at once into the job's
  buffer, and one writer per job sends the buffer in one HSET at a time (a newer meta of a sample
  replaces an unsent older one; segments are never dropped; a failed send keeps its fields for the
  next). ``flush`` waits until the buffer is in Redis: the final checkpoint and a drain stop wait,
  so a drained or finished sample's state is in Redis before its job is handed back or published.
- Append-only: a checkpoint writes one new segment (only the new tokens) and overwrites the small
  meta in the same HSET, so the meta always names complete segments and the bytes written are
  linear in the response length. A replica presumed dead that still writes never corrupts another
  replica's lineage: segment names carry the writer's id and the meta lists exactly its lineage.
- A sample resumed from a checkpoint keeps its tokens, log-probs (rounded to float32, as the wire
  does) and per-token versions exactly; only what came after the checkpoint is generated again
  (from a mid-turn checkpoint: the rest of its open turn, asked for as a continuation).
- A checkpoint (mid-turn or not) is not resumed when its oldest generated token is more than
  ``max_staleness`` versions behind the engine's weights (``restarted{reason="stale"}``), nor when
  its session cells replay to different outputs (``restarted{reason="replay_mismatch"}``, see
  ``loop.py``); a sample
  that a previous attempt had started (heartbeat progress) but never checkpointed restarts too
  (``restarted{reason="no_checkpoint"}``), so every sample of a dead replica that continues is counted.
- ``tokens_regenerated`` = max(0, heartbeat progress - checkpointed length) per continued or
  restarted sample (the whole progress for one without a checkpoint): a lower bound, at heartbeat
  granularity (tokens generated after the dead replica's last beat are not seen); the tokens of a
  checkpoint that is not kept (stale, not replayable) are ``tokens_discarded``, counted apart.
- The hash is deleted in the MULTI/EXEC that publishes the job's group (``publish_and_ack``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np

from services.common.group_wire import PackedIds, pack_ids, trajectory_columns, unpack_ids, version_runs
from services.common.schemas import pack_array, packed_array, unpack_map

RESTART_REASONS = ("stale", "replay_mismatch", "no_checkpoint")


def checkpoint_key(prompts_stream: str, job_id: str) -> str:
    return f"{prompts_stream}:ckpt:{job_id}"


class CheckpointObserver:
    """Counts what checkpoints write and save; the rollout's Prometheus metrics extend it."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.seconds_writing = 0.0
        self.tokens_resumed = 0
        self.tokens_regenerated = 0
        self.tokens_discarded = 0
        self.samples_resumed = 0
        self.samples_restarted: dict[str, int] = dict.fromkeys(RESTART_REASONS, 0)

    def written(self, nbytes: int, seconds: float) -> None:
        self.bytes_written += nbytes
        self.seconds_writing += seconds

    def resumed(self, tokens: int) -> None:
        self.samples_resumed += 1
        self.tokens_resumed += tokens

    def restarted(self, reason: str) -> None:
        self.samples_restarted[reason] += 1

    def discarded(self, tokens: int) -> None:
        self.tokens_discarded += tokens

    def regenerated(self, tokens: int) -> None:
        self.tokens_regenerated += tokens


# ---- one segment --------------------------------------------------------------------------------
def encode_segment(ids: list[int], mask: list[int], logprobs: list[float], versions: list[int],
                   cells: list[tuple[str, str]]) -> bytes:
    """The tokens (and session cells) added since the previous checkpoint, compactly encoded."""
    cols = SimpleNamespace(response_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions)
    ids_np, vers_np, gen_lps = trajectory_columns(cols, "checkpoint segment")
    run_versions, run_lengths, _ = version_runs(vers_np, np.array([len(ids_np)], dtype=np.int64))
    return msgpack.packb({
        "ids": pack_ids(ids_np, "checkpoint segment ids"),
        "run_versions": pack_array(run_versions, np.int32),
        "run_lengths": pack_array(run_lengths, np.uint32),
        "logprobs": gen_lps.astype("<f4", copy=False).tobytes(),
        "cells": [list(c) for c in cells],
    }, use_bin_type=True)


def decode_segment(raw: bytes) -> tuple[list[int], list[int], list[float], list[int], list[tuple[str, str]]]:
    """(ids, loss mask, log-probs, versions, cells) of a segment; ValueError naming the bad field."""
    data = unpack_map(raw, "checkpoint segment")
    run_versions = packed_array(data.get("run_versions"), np.int32, "checkpoint run_versions")
    run_lengths = packed_array(data.get("run_lengths"), np.uint32, "checkpoint run_lengths")
    if len(run_versions) != len(run_lengths):
        raise ValueError("checkpoint run_versions and run_lengths differ in length")
    versions = np.repeat(run_versions.astype(np.int64), run_lengths)
    ids = unpack_ids(PackedIds.model_validate(data.get("ids")), "checkpoint ids", len(versions))
    generated = versions != -1
    compact = packed_array(data.get("logprobs"), np.float32, "checkpoint logprobs")
    if len(compact) != int(generated.sum()):
        raise ValueError(f"checkpoint logprobs: {len(compact)} values for "
                         f"{int(generated.sum())} generated tokens")
    logprobs = np.zeros(len(versions), dtype=np.float64)
    logprobs[generated] = compact
    cells = data.get("cells", [])
    if not isinstance(cells, list) or not all(isinstance(c, list) and len(c) == 2 for c in cells):
        raise ValueError("checkpoint cells: expected a list of [code, output] pairs")
    return (ids.tolist(), generated.astype(np.int64).tolist(), logprobs.tolist(), versions.tolist(),
            [(str(c[0]), str(c[1])) for c in cells])


# ---- a sample's saved state ---------------------------------------------------------------------
@dataclass
class SampleCheckpoint:
    """A sample's state as last checkpointed (the fields of the loop's ``_State`` plus its cells)."""

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_call_errors: list[bool] = field(default_factory=list)
    first_code_token: int | None = None
    cells: list[tuple[str, str]] = field(default_factory=list)
    finish: tuple[str, bool] | None = None  # (finish reason, truncated) of a finished sample
    turn_start: int | None = None  # mid-turn (a weight swap): where the open turn starts; None: boundary
    segments: list[str] = field(default_factory=list)

    def oldest_version(self) -> int | None:
        gen = [v for v in self.versions if v != -1]
        return min(gen) if gen else None


def _load_sample(meta_raw: bytes, fields: dict[bytes, bytes]) -> SampleCheckpoint:
    meta = unpack_map(meta_raw, "checkpoint meta")
    ck = SampleCheckpoint(turns=int(meta["turns"]), tool_calls=int(meta["tool_calls"]),
                          tool_errors=int(meta["tool_errors"]),
                          tool_call_errors=[bool(x) for x in meta["tool_call_errors"]],
                          first_code_token=meta.get("first_code_token"),
                          finish=None if meta.get("finish") is None else (str(meta["finish"][0]),
                                                                           bool(meta["finish"][1])),
                          turn_start=None if meta.get("turn_start") is None else int(meta["turn_start"]),
                          segments=[str(s) for s in meta["segments"]])
    for name in ck.segments:
        raw = fields.get(name.encode())
        if raw is None:
            raise ValueError(f"checkpoint segment {name} is missing")
        ids, mask, lps, vers, cells = decode_segment(raw)
        ck.response_ids += ids
        ck.loss_mask += mask
        ck.logprobs += lps
        ck.versions += vers
        ck.cells += cells
    if len(ck.response_ids) != int(meta["length"]):
        raise ValueError(f"checkpoint holds {len(ck.response_ids)} tokens, its meta says {meta['length']}")
    n = len(ck.response_ids)
    if ck.turn_start is not None and not 0 <= ck.turn_start <= n:
        raise ValueError(f"checkpoint turn_start {ck.turn_start} is outside its {n} tokens")
    return ck


class JobCheckpoints:
    """The checkpoints of one job on one replica: load once at the start, save at turn boundaries
    (``st.turn_start``, not None for a mid-turn save, is recorded as the open turn's start)."""

    def __init__(self, client: Any, key: str, *, ttl_s: int, max_staleness: int,
                 observer: CheckpointObserver | None = None) -> None:
        self.client = client
        self.key = key
        self.ttl_s = ttl_s
        self.max_staleness = max_staleness
        self.observer = observer or CheckpointObserver()
        self.writer = secrets.token_hex(4)
        self.saved: dict[int, SampleCheckpoint] = {}
        self.progress: dict[int, int] = {}  # heartbeat progress of the previous attempt
        self.live: dict[int, Any] = {}  # index -> the running sample's state (its length is progress)
        self._lineage: dict[int, list[str]] = {}
        self._saved_len: dict[int, int] = {}
        self._saved_cells: dict[int, int] = {}
        self._buffer: dict[str, bytes] = {}  # fields not sent yet
        self._encode_s = 0.0
        self._writer: asyncio.Future[None] | None = None

    async def load(self) -> None:
        """Read every sample's checkpoint in one round trip; an unreadable one is dropped (restart)."""
        fields: dict[bytes, bytes] = await self.client.hgetall(self.key) or {}
        for name, raw in fields.items():
            if name.startswith(b"p"):
                self.progress[int(name[1:])] = int(raw)
            elif name.startswith(b"m"):
                try:
                    self.saved[int(name[1:])] = _load_sample(raw, fields)
                except (ValueError, KeyError, TypeError):
                    continue  # a damaged checkpoint: that sample restarts from its prompt

    # -- resume --------------------------------------------------------------------------------
    def resume_point(self, index: int, engine_version: int) -> SampleCheckpoint | None:
        """The checkpoint sample ``index`` continues from; None (counted) when it restarts."""
        ck = self.saved.get(index)
        if ck is None:
            if self.progress.get(index, 0) > 0:  # started by a previous attempt, never checkpointed
                self.restart(index, "no_checkpoint")
            return None
        oldest = ck.oldest_version()
        if oldest is not None and engine_version - oldest > self.max_staleness:
            self.restart(index, "stale")
            return None
        return ck

    def resumed(self, index: int, ck: SampleCheckpoint) -> None:
        """Sample ``index`` continues from ``ck``: later checkpoints append to its lineage."""
        self._lineage[index] = list(ck.segments)
        self._saved_len[index] = len(ck.response_ids)
        self._saved_cells[index] = len(ck.cells)
        self.observer.resumed(len(ck.response_ids))
        self.observer.regenerated(max(0, self.progress.get(index, 0) - len(ck.response_ids)))

    def restart(self, index: int, reason: str) -> None:
        """Sample ``index`` restarts from its prompt: counted by ``reason``, with the tokens of a
        checkpoint it does not keep (``discarded``: stale or not replayable, generated again by
        choice) apart from the tokens the previous attempt had generated past its last checkpoint
        (``regenerated``: lost to the fault)."""
        self.observer.restarted(reason)
        ck = self.saved.get(index)
        kept = len(ck.response_ids) if ck is not None else 0
        self.observer.discarded(kept)
        self.observer.regenerated(max(0, self.progress.get(index, 0) - kept))

    # -- save ----------------------------------------------------------------------------------
    async def save(self, index: int, st: Any, finish: tuple[str, bool] | None = None, *,
                   wait: bool = False) -> None:
        """Append the tokens and cells ``st`` gained since this sample's previous checkpoint: encoded
        now, sent in the background by the job's writer (``wait``: and flushed)."""
        start = time.perf_counter()
        at, cells_at = self._saved_len.get(index, 0), self._saved_cells.get(index, 0)
        lineage = self._lineage.setdefault(index, [])
        end = len(st.response_ids)
        out: dict[str, bytes] = {}
        if end > at or len(st.cells) > cells_at:
            name = f"{index}:{self.writer}:{len(lineage)}"
            out[name] = encode_segment(st.response_ids[at:end], st.loss_mask[at:end], st.logprobs[at:end],
                                       st.versions[at:end], st.cells[cells_at:])
            lineage.append(name)
        out[f"m{index}"] = msgpack.packb({
            "segments": lineage, "length": end, "turns": st.turns, "tool_calls": st.tool_calls,
            "tool_errors": st.tool_errors, "tool_call_errors": st.tool_call_errors,
            "first_code_token": st.first_code_token, "finish": None if finish is None else list(finish),
            "turn_start": st.turn_start,
        }, use_bin_type=True)
        self._saved_len[index], self._saved_cells[index] = end, len(st.cells)
        self._buffer.update(out)
        self._encode_s += time.perf_counter() - start
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._send())
        if wait:
            await self.flush()

    async def _send(self) -> None:
        while self._buffer:
            batch, self._buffer = self._buffer, {}
            start = time.perf_counter()
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.hset(self.key, mapping=batch)
                    pipe.expire(self.key, self.ttl_s)
                    await pipe.execute()
            except BaseException:
                self._buffer = {**batch, **self._buffer}  # newer fields win; the next send retries
                raise
            encode_s, self._encode_s = self._encode_s, 0.0
            self.observer.written(sum(len(k) + len(v) for k, v in batch.items()),
                                  encode_s + time.perf_counter() - start)

    async def flush(self) -> None:
        """Wait until every checkpoint saved so far is in Redis; raises the writer's error."""
        while self._buffer or (self._writer is not None and not self._writer.done()):
            if self._writer is None or self._writer.done():
                self._writer = asyncio.ensure_future(self._send())
            writer = self._writer  # a save may start the next one while this one ends
            await asyncio.wait([writer])
            if (error := writer.exception()) is not None:
                raise error

    def progress_fields(self) -> dict[str, int]:
        """``p<i>``: each running sample's response length now (written by the worker's heartbeat)."""
        return {f"p{i}": len(st.response_ids) for i, st in self.live.items()}

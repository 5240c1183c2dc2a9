"""The weight-push test harness: a real (tiny) HF engine behind a real gRPC weight server on
loopback, in the test process so a test can look at the engine's parameters, and the checks the
push tests make on it. Nothing is mocked."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from services.common.metrics import MetricsRegistry
from services.rollout.engine.base import SamplingParams, collect
from services.rollout.engine.hf import HFEngine
from services.rollout.weights.server import start_weight_server
from services.transport.weights.client import close_shm_mappings

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@contextlib.asynccontextmanager
async def hf_replica(model_dir: str | Path, token: str,
                     registry: MetricsRegistry | None = None) -> AsyncIterator[tuple[HFEngine, str]]:
    """(engine, ``host:port`` of its weight server); on exit the server stops, the client's shm
    mappings close and the engine shuts down."""
    engine = HFEngine(str(model_dir))
    server = await start_weight_server(engine, "127.0.0.1", 0, token, registry=registry)
    try:
        yield engine, f"127.0.0.1:{server.port}"
    finally:
        close_shm_mappings()
        await server.stop(None)
        await engine.shutdown()


def snapshot(engine: HFEngine) -> dict[str, torch.Tensor]:
    """A copy of every weight the engine serves (to compare after a push that must change nothing)."""
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def greedy(engine: HFEngine) -> list[int]:
    """The engine's greedy answer to a fixed prompt (different weights answer differently)."""
    prompt = engine.tokenizer.encode("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    return (await collect(engine, prompt, GREEDY, "g"))[0].token_ids


async def greedy_of(model_dir: str | Path) -> list[int]:
    """``greedy`` of a fresh engine on ``model_dir`` (what a replica must answer once it serves those
    weights); the engine is shut down before returning."""
    reference = HFEngine(str(model_dir))
    try:
        return await greedy(reference)
    finally:
        await reference.shutdown()


def train_once(model: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """One optimiser step of ``model`` (a transformers causal LM) on random tokens; its parameters
    after it (a trainer's master weights, as the pusher gets them)."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}

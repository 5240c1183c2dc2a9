"""Delta weight pushes into a real vLLM replica (CPU build, serving bf16) over real gRPC on loopback.

vLLM has no in-place patch: its weight server keeps a host copy of what it serves (the pushed tensors,
in the serving dtype), applies each delta to a staged copy of the changed tensors and reloads the
whole model through vLLM's exact reload path. The trainer side is ``WeightPusher`` fed by real AdamW
steps of an fp32 model; a transformers replica (also bf16) takes the same pushes next to it.

Checked over 21 versions:
- after every push the vLLM replica's host copy is bit for bit the cast of the master weights (what
  it loaded into vLLM), and so are the transformers replica's weights;
- what vLLM *serves* after a chain of deltas equals what it serves after a full push of the same
  weights: greedy tokens and every log-prob exactly (same weights, same kernels, same numbers);
- a push the vLLM replica misses (it is out of the target set) is made up by a full push;
- a replica whose weights changed behind the pusher's back (an operator's full push, no lineage)
  refuses the next delta with FAILED_PRECONDITION and gets a full push instead.
vLLM starts once for the module (20-45 s here).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from services.common.metrics import MetricsRegistry
from services.rollout.engine.base import SamplingParams, collect
from services.rollout.weights.server import WeightServer, start_weight_server
from services.trainer.push import WeightPusher
from services.transport.weights.client import get_replica_state, push_state_dict_async
from tests.helpers.engines import VLLM_TEST_KWARGS
from tests.helpers.tiny_model import tiny_model_dir
from tests.helpers.weight_replica import train_once

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
TOKEN = "vllm-delta-token-41aa"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


class Served:
    def __init__(self, engine: Any, server: WeightServer, registry: MetricsRegistry) -> None:
        self.engine, self.server, self.registry = engine, server, registry

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def metric(self, text: str) -> bool:
        return text in self.registry.render().decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory, "small", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(model_dir) -> AsyncIterator[tuple[Served, Served]]:
    from services.rollout.engine.hf import HFEngine
    from services.rollout.engine.vllm_engine import VLLMEngine

    vllm = VLLMEngine(model_dir, **{**VLLM_TEST_KWARGS, "dtype": "bfloat16"})
    hf = HFEngine(model_dir, dtype="bfloat16")
    started = []
    try:
        for engine in (vllm, hf):
            registry = MetricsRegistry("test")
            server = await start_weight_server(engine, "127.0.0.1", 0, TOKEN, registry=registry)
            started.append(Served(engine, server, registry))
        yield started[0], started[1]
    finally:
        for s in started:
            await s.server.stop(None)
        await hf.shutdown()
        await vllm.shutdown()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy()


def _assert_host_copy(replica: Served, master: dict[str, torch.Tensor]) -> None:
    """The vLLM replica's host copy (the tensors it loaded into vLLM) is the bf16 cast of ``master``."""
    served = replica.server.servicer._served
    assert set(served) == set(master)
    for name, t in master.items():
        assert served[name].dtype == torch.bfloat16
        assert np.array_equal(_bits(served[name]), _bits(t.to(torch.bfloat16))), name


def _assert_hf(replica: Served, master: dict[str, torch.Tensor]) -> None:
    live = dict(replica.engine.model.named_parameters())
    for name, t in master.items():
        assert np.array_equal(_bits(live[name]), _bits(t.to(torch.bfloat16))), name


def _prompt(engine: Any) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 2+3 with code."}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


async def _served_outputs(engine: Any, tag: str) -> tuple[list[int], list[float]]:
    [res] = await collect(engine, _prompt(engine), GREEDY, tag)
    assert set(res.versions) == {engine.version}
    return res.token_ids, res.logprobs


async def _full_push_of(replica: Served, master: dict[str, torch.Tensor], version: int) -> None:
    """An operator's full push (no lineage) of the bf16 cast of ``master``."""
    await push_state_dict_async(((n, t.to(torch.bfloat16)) for n, t in master.items()), [replica.target],
                                version, TOKEN, 64 << 10)
    assert (await get_replica_state(replica.target)).lineage == ""


async def test_chain_of_deltas_into_vllm_serves_exactly_the_full_push(replicas, model_dir):
    from transformers import AutoModelForCausalLM

    vllm, hf = replicas
    assert vllm.engine.serving_dtype == "bfloat16"
    state = await get_replica_state(vllm.target)
    assert state.serving_dtype == "bfloat16" and state.lineage == ""
    tokens0, logprobs0 = await _served_outputs(vllm.engine, "v0")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    everyone = [vllm.target, hf.target]
    pusher = WeightPusher(everyone, TOKEN, bucket_bytes=64 << 10, backoff_s=0)
    kinds: dict[int, tuple[float, float, float]] = {}
    compared: list[int] = []
    try:
        for version in range(1, 22):
            master = train_once(model, opt)
            pusher.entries = [hf.target] if version == 6 else everyone  # v6: vLLM misses it
            m = await pusher.push(master, version)
            kinds[version] = (m["weights/push_delta_targets"], m["weights/push_full_targets"],
                              m["weights/push_fallbacks"])
            if m["weights/push_delta_targets"]:
                assert 0 < m["weights/push_density"] < 0.5, version
            if m["weights/push_delta_targets"] and not m["weights/push_full_targets"]:
                assert m["weights/push_wire_bytes"] < 0.5 * m["weights/push_full_bytes"] * 2, version
            _assert_hf(hf, master)
            if version == 6:
                assert vllm.engine.version == 5
                continue
            assert vllm.engine.version == version
            _assert_host_copy(vllm, master)
            if version in (12, 21):  # served outputs after deltas == after a full push of the same weights
                after_deltas = await _served_outputs(vllm.engine, f"delta-{version}")
                await _full_push_of(vllm, master, version)  # clears the lineage: the next delta is stale
                after_full = await _served_outputs(vllm.engine, f"full-{version}")
                assert after_deltas[0] == after_full[0]
                assert after_deltas[1] == after_full[1]  # exactly: bit-identical weights
                assert after_deltas[1] != logprobs0 or after_deltas[0] != tokens0  # the weights did move
                compared.append(version)
    finally:
        pusher.close()
    assert compared == [12, 21]
    assert kinds[1] == (0, 2, 0)  # no base yet: full pushes
    assert kinds[6] == (1, 0, 0)  # only the transformers replica
    assert kinds[7] == (1, 1, 0)  # vLLM (at v5) gets a full push, no round trip to learn it
    assert kinds[13] == (1, 1, 1)  # vLLM refused the delta (FAILED_PRECONDITION) -> full push
    deltas_everywhere = set(range(2, 22)) - {6, 7, 13}
    assert all(kinds[v] == (2, 0, 0) for v in deltas_everywhere), kinds
    assert vllm.metric('test_weight_pushes_total{outcome="stale_base"} 1.0')
    assert vllm.metric(f'test_weight_pushes_applied_total{{kind="delta"}} {float(len(deltas_everywhere))}')
    assert vllm.engine.health_error() is None

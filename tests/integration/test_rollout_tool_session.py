"""``tool_session: persistent`` end to end: the agent loop against the real sandbox service.

The token stream comes from a scripted engine (a random tiny model cannot be made to write
tool calls); the sandbox, its sessions and their isolation are real."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest

from services.rollout.agent.loop import AgentLoop
from services.rollout.agent.sandbox import SandboxTool
from services.rollout.config import AgentConfig
from services.sandbox.launcher import SandboxProcess
from services.transport.sandbox.client import SandboxClient
from tests.helpers.agent_fixtures import ScriptedEngine, make_tokenizer
from tests.integration.sandbox_client import sandbox_pids

pytestmark = pytest.mark.integration
TOK = make_tokenizer()
MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]
SCRIPT = ["First a variable.\n<code>\n```python\nx = 6 * 7\nprint('set')\n```\n</code>",
          "Now use it.\n<code>\n```python\nprint(x)\nx + 1\n```\n</code>",
          "So <answer>\\boxed{42}</answer>"]


def _live_sessions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("sandbox_sessions_live "))


def _opened(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("sandbox_sessions_opened_total "))


async def _run(sandbox_url: str, mode: str) -> Any:
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    try:
        loop = AgentLoop(ScriptedEngine(TOK, list(SCRIPT)), TOK, sandbox, AgentConfig(tool_session=mode))
        return await loop.run_one(loop.build_prompt(MESSAGES))
    finally:
        await sandbox.aclose()


async def test_persistent_mode_keeps_variables_across_calls_and_closes_the_session(sandbox, sandbox_url):
    opened = _opened(sandbox_url)
    traj = await _run(sandbox_url, "persistent")
    assert (traj.finish_reason, traj.tool_calls, traj.tool_errors) == ("answer", 2, 0)
    assert "<interpreter>\nset\n</interpreter>" in traj.response_text
    assert "<interpreter>\n42\n43\n</interpreter>" in traj.response_text  # print, then the displayed x + 1
    assert _opened(sandbox_url) == opened + 1  # one session for the whole trajectory
    assert _live_sessions(sandbox_url) == 0.0  # closed when the trajectory ended
    deadline = time.monotonic() + 10
    while sandbox_pids(under=sandbox.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_pids(under=sandbox.proc.pid) == []


async def test_stateless_mode_stays_the_default_and_forgets_between_calls(sandbox_url):
    assert AgentConfig().tool_session == "stateless"
    opened = _opened(sandbox_url)
    traj = await _run(sandbox_url, "stateless")
    assert traj.tool_errors == 1 and "NameError: name 'x' is not defined" in traj.response_text
    assert _opened(sandbox_url) == opened


async def test_a_session_that_ended_tells_the_model_why(sandbox_url):
    script = ["<code>\n```python\nimport os\nos._exit(3)\n```\n</code>", "<code>print(1)</code>", "done"]
    sandbox = SandboxTool(SandboxClient(sandbox_url))
    try:
        loop = AgentLoop(ScriptedEngine(TOK, script), TOK, sandbox, AgentConfig(tool_session="persistent"))
        traj = await loop.run_one(loop.build_prompt(MESSAGES))
    finally:
        await sandbox.aclose()
    assert traj.tool_errors == 2
    blocks = [b.split("</interpreter>")[0] for b in traj.response_text.split("<interpreter>")[1:]]
    assert len(blocks) == 2  # the cell that ended the session, then the next call: both say why
    assert all("session" in b and "ended: its interpreter exited with code 3" in b for b in blocks), blocks
    assert _live_sessions(sandbox_url) == 0.0


async def test_a_sessions_calls_stay_on_the_replica_that_opened_it(sandbox_url, tmp_path, monkeypatch):
    """Two real sandbox replicas (127.0.0.1 and 127.0.0.2, same port) behind one name, as Docker's
    DNS serves ``--scale sandbox=2``. Only the name's resolution is stood in for (no DNS server
    with two A records exists here); sessions spread over both replicas and each keeps its state."""
    port = int(sandbox_url.rsplit(":", 1)[1])
    args = ["--set", "max_concurrency=2", "--set", "zygotes=1", "--set", "light_zygotes=0",
            "--set", "heavy_zygotes=0", "--set", "max_sessions=16"]
    with SandboxProcess(args, host="127.0.0.2", port=port, log_path=str(tmp_path / "sb2.log")) as second:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def two_replicas(host, *a, **kw):
            if host != "sandbox.replicas":
                return await real(host, *a, **kw)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                    for ip in ("127.0.0.1", "127.0.0.2")]

        monkeypatch.setattr(loop, "getaddrinfo", two_replicas)
        opened = (_opened(sandbox_url), _opened(second.url))
        client = SandboxTool(SandboxClient(f"http://sandbox.replicas:{port}"))
        try:
            sids = [await client.open_session() for _ in range(16)]
            for step in range(4):
                outs = [await client.run("n = 0" if step == 0 else "n += 1\nn", session_id=s) for s in sids]
                assert all(not o.error and o.text == ("" if step == 0 else str(step)) for o in outs), outs
            for s in sids:
                await client.close_session(s)
        finally:
            await client.aclose()
        first_n, second_n = _opened(sandbox_url) - opened[0], _opened(second.url) - opened[1]
        assert first_n + second_n == 16 and first_n > 0 and second_n > 0
        assert _live_sessions(sandbox_url) == 0.0 and _live_sessions(second.url) == 0.0

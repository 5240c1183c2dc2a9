"""SFT rendering: the inline layout is token-for-token what the rollout agent loop produces for the
same trace (driven by the real AgentLoop with a scripted engine replaying the trace's assistant
tokens and a tool runner returning the trace's outputs); masks line up; truncation is counted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.chat.tool_result import ToolResult
from services.common.config import ConfigError
from services.data.io import write_rows
from services.data.retool_sft import to_messages
from services.models.tiny import build_tokenizer
from services.rollout.agent.loop import AgentLoop
from services.rollout.config import AgentConfig
from services.trainer.sft.config import SFTDataConfig
from services.trainer.sft.data import load_samples
from services.trainer.sft.render import RenderError, assistant_text, render, tool_result_text
from tests.helpers.agent_fixtures import ScriptedEngine
from tests.helpers.masks import spans

TOK = build_tokenizer(2048)
LONG_OUTPUT = "".join(f"line {i}: {i * i}\n" for i in range(40))
TRACE = (
    "Let me compute the sum first.\n<code>\n```python\nprint(sum(range(10)))\n```\n</code>\n"
    "<interpreter>\n45\n</interpreter>\nNow the squares.\n<code>\n```python\nfor i in range(40): "
    f"print(f'line {{i}}: {{i*i}}')\n```\n</code>\n<interpreter>\n{LONG_OUTPUT}</interpreter>\n"
    "So the answer is 45.\n<answer>\\boxed{45}</answer>"
)


class TraceTools:
    """Returns the trace's tool outputs in order (what the sandbox printed when the trace was made)."""

    def __init__(self, outputs: list[str]) -> None:
        self.outputs = list(outputs)

    async def run(self, code: str) -> ToolResult:
        return ToolResult(self.outputs.pop(0), False, 0.0)


def agent_loop_tokens(messages: list[dict[str, Any]], agent: AgentConfig, *, final_eos: bool
                      ) -> tuple[list[int], list[int]]:
    """prompt + response ids and mask, produced by the rollout's AgentLoop replaying the trace."""
    script: list[Any] = []
    assistants = [m for m in messages if m["role"] == "assistant"]
    for i, m in enumerate(assistants):
        ids = TOK.encode(assistant_text(m), add_special_tokens=False)
        script.append(ids + ([TOK.eos_token_id] if final_eos and i == len(assistants) - 1 else []))
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    loop = AgentLoop(ScriptedEngine(TOK, script), TOK, TraceTools(outputs), agent)
    prompt = loop.build_prompt([m for m in messages if m["role"] in ("system", "user")])
    traj = asyncio.run(loop.run_one(prompt))
    ends_at_answer = agent.stop_at_answer and "</answer>" in assistants[-1]["content"]
    assert traj.tool_calls == len(outputs) and traj.finish_reason == ("answer" if ends_at_answer else "eos")
    return prompt + traj.response_ids, [0] * len(prompt) + traj.loss_mask


@pytest.mark.parametrize("fmt", ["code", "hermes"])
@pytest.mark.parametrize("stop_at_answer", [False, True])
def test_inline_render_equals_agent_loop_tokens(fmt: str, stop_at_answer: bool) -> None:
    messages = to_messages("What is the sum of 0..9?", TRACE, fmt)  # type: ignore[arg-type]
    agent = AgentConfig(tool_format=fmt, max_tool_output_chars=120, stop_at_answer=stop_at_answer)  # type: ignore[arg-type]
    # with stop_at_answer the loop ends at the generated </answer> (no EOS); otherwise the model ends with EOS
    got = render(messages, TOK, agent, "inline", append_eos=not stop_at_answer)
    ids, mask = agent_loop_tokens(messages, agent, final_eos=not stop_at_answer)
    assert got.input_ids == ids
    assert got.loss_mask == mask
    assert len(LONG_OUTPUT) > agent.max_tool_output_chars  # the long output was cut, as the loop does


def test_inline_mask_covers_exactly_the_assistant_tokens() -> None:
    messages = to_messages("What is the sum of 0..9?", TRACE, "code")
    agent = AgentConfig()
    r = render(messages, TOK, agent, "inline")
    assert len(r.input_ids) == len(r.loss_mask) and r.loss_mask[0] == 0
    ones = [TOK.decode(r.input_ids[a:b]) for a, b in spans(r.loss_mask, 1)]
    assistants = [m["content"] for m in messages if m["role"] == "assistant"]
    assert ones == [*assistants[:-1], assistants[-1] + "<|im_end|>"]
    assert r.input_ids[-1] == TOK.eos_token_id and r.loss_mask[-1] == 1
    zeros = [TOK.decode(r.input_ids[a:b]) for a, b in spans(r.loss_mask, 0)]
    tools = [m["content"] for m in messages if m["role"] == "tool"]
    assert zeros[0] == TOK.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert zeros[1:] == [tool_result_text(t, agent) for t in tools]
    assert "<interpreter>" in zeros[1] and zeros[1].endswith("</interpreter>\n")


def test_chat_template_render_masks_assistant_bodies() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *to_messages("Sum 0..9?", TRACE, "code")]
    r = render(messages, TOK, AgentConfig(), "chat_template")
    assert len(r.input_ids) == len(r.loss_mask) and r.loss_mask[0] == 0
    assert TOK.decode(r.input_ids) == TOK.apply_chat_template(messages, tokenize=False)
    ones = [TOK.decode(r.input_ids[a:b]) for a, b in spans(r.loss_mask, 1)]
    assert ones == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    # tool turns are chat messages here, entirely masked
    zeros = TOK.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m == 0])
    assert "<|im_start|>tool\n45<|im_end|>" in zeros


def test_chat_template_that_is_not_prefix_stable_is_rejected() -> None:
    class Unstable:
        eos_token_id = TOK.eos_token_id

        def apply_chat_template(self, msgs: list[dict[str, Any]], add_generation_prompt: bool = False,
                                **_: Any) -> str:
            return f"[{len(msgs)}]" + "".join(m["content"] for m in msgs)

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(text.encode())

    with pytest.raises(RenderError, match="prefix-stable"):
        render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], Unstable(),
               AgentConfig(), "chat_template")


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "q"}], "no assistant"),
    ([{"role": "assistant", "content": "a"}], "no prompt"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "user", "content": "again"}, {"role": "assistant", "content": "b"}], "one response"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "tool", "content": "1"}], "end with an assistant"),
])
def test_inline_rejects_conversations_the_agent_loop_cannot_produce(messages: list[dict[str, Any]],
                                                                    match: str) -> None:
    with pytest.raises(RenderError, match=match):
        render(messages, TOK, AgentConfig(), "inline")


def _write_data(tmp_path: Any) -> tuple[str, list[int]]:
    rows = []
    for n in (1, 4, 16):
        trace = "\n".join(f"step {i} <code>\nprint({i})\n</code>\n<interpreter>\n{i}\n</interpreter>"
                          for i in range(n)) + "\n<answer>\\boxed{1}</answer>"
        rows.append({"messages": to_messages(f"problem {n}", trace, "code")})
    rows.append({"messages": [{"role": "user", "content": "only a question", "tool_calls": None}]})
    path = tmp_path / "sft.parquet"
    write_rows(path, rows)
    lengths = [len(render(r["messages"], TOK, AgentConfig(), "inline")) for r in rows[:3]]
    return str(path), lengths


def test_length_policies_are_counted_never_silent(tmp_path: Any) -> None:
    path, lengths = _write_data(tmp_path)
    cut = (lengths[1] + lengths[2]) // 2  # the longest sample is over the limit, the others fit
    drop, rep = load_samples(SFTDataConfig(train_files=[path], max_length=cut), TOK, AgentConfig())
    assert (rep.rows, rep.used, rep.dropped_too_long, rep.truncated, rep.bad) == (4, 2, 1, 0, 1)
    assert [len(s) for s in drop] == lengths[:2]
    assert "no assistant" in rep.summary() and "1 dropped" in rep.summary()

    trunc, rep = load_samples(SFTDataConfig(train_files=[path], max_length=cut, truncation="truncate"),
                              TOK, AgentConfig())
    assert (rep.used, rep.dropped_too_long, rep.truncated) == (3, 0, 1)
    full = render(json.loads(json.dumps(_rows(path)[2])), TOK, AgentConfig(), "inline")
    assert trunc[2].input_ids == full.input_ids[:cut] and trunc[2].loss_mask == full.loss_mask[:cut]
    assert rep.longest == cut

    with pytest.raises(ConfigError, match="row 2 has .* tokens > data.max_length"):
        load_samples(SFTDataConfig(train_files=[path], max_length=cut, truncation="error"), TOK,
                     AgentConfig())
    with pytest.raises(ConfigError, match="no usable SFT sample"):
        load_samples(SFTDataConfig(train_files=[path], max_length=lengths[0] - 1), TOK, AgentConfig())


def _rows(path: str) -> list[list[dict[str, Any]]]:
    from services.data.io import iter_rows

    return [row["messages"] for _, row in iter_rows(path)]

"""A real (tiny, byte-level) HF tokenizer and a scripted engine for agent-loop tests.

The scripted engine implements the Engine protocol by replaying a scripted token stream per
``generate`` call, with the same stop/EOS/length semantics as the real engines (the tokens
that complete a stop string are kept). It stands in for a language model only where a
deterministic token stream is needed (a real model's output cannot be scripted).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest

from services.common.process import ServiceProcess
from services.rollout.engine.base import GenerationChunk, SamplingParams

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# multi-character tokens so that a stop string can end in the middle of a token
EXTRA_TOKENS = ("</code>\n\n", "de>\nAfter", "</tool_call>!")


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for extra in EXTRA_TOKENS:
        vocab["".join(t for t, _ in byte_level.pre_tokenize_str(extra))] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def extra_token_id(tokenizer: Any, text: str) -> int:
    ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == text]
    assert len(ids) == 1, text
    return ids[0]


class ScriptedEngine:
    """Each ``generate`` call replays the next script entry, n == 1 only.

    A text entry is encoded and followed by EOS; a list entry is replayed as is (no EOS added).
    ``script`` is one list shared by all calls, or a dict of lists keyed by the sample index (the
    agent loop's request ids end with ``-<index>-t<turn>``), for concurrent samples.
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Iterable[str | list[int]] | dict[int, list[str | list[int]]],
        *,
        version: int = 0,
        chunk_size: int = 3,
    ) -> None:
        self.tokenizer = tokenizer
        self.scripts = {k: list(v) for k, v in script.items()} if isinstance(script, dict) else None
        self.script = [] if isinstance(script, dict) else list(script)
        self._version = version
        self.chunk_size = chunk_size
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    @property
    def version(self) -> int:
        return self._version

    def _tokens(self, entry: str | list[int]) -> list[int]:
        if isinstance(entry, list):
            return list(entry)
        return self.tokenizer.encode(entry, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        assert params.n == 1
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        script = self.script if self.scripts is None else self.scripts[int(request_id.split("-")[-2])]
        tokens = self._tokens(script.pop(0)) if script else [self.tokenizer.eos_token_id]
        out: list[int] = []
        reason, stop_str = "eos", None
        for tok in tokens:
            if len(out) >= params.max_tokens:
                reason = "length"
                break
            out.append(tok)
            if tok == self.tokenizer.eos_token_id:
                reason = "eos"
                break
            text = self.tokenizer.decode(out)
            hit = [s for s in params.stop if s in text]
            if hit:
                reason, stop_str = "stop", min(hit, key=text.find)
                break
        for i in range(0, len(out), self.chunk_size):
            part = out[i : i + self.chunk_size]
            last = i + self.chunk_size >= len(out)
            lps = [-0.5 - 0.01 * (i + k) for k in range(len(part))]
            yield GenerationChunk(
                index=0,
                token_ids=part,
                logprobs=lps,
                versions=[self._version] * len(part),
                finished=last,
                finish_reason=reason if last else None,
                stop_str=stop_str if last else None,
            )
        if not out:
            yield GenerationChunk(
                index=0,
                token_ids=[],
                logprobs=[],
                versions=[],
                finished=True,
                finish_reason=reason,
                stop_str=stop_str,
            )

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        self._version = version

    async def shutdown(self) -> None:
        return None


class EndlessEngine:
    """Streams one token every 10 ms forever; records which requests are running and which were closed."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.version = 0
        self.running: set[str] = set()
        self.closed: list[str] = []
        self.tokens = 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        token = self.tokenizer.encode("a", add_special_tokens=False)[0]
        self.running.add(request_id)
        try:
            while True:
                await asyncio.sleep(0.01)
                self.tokens += 1
                yield GenerationChunk(
                    index=0, token_ids=[token], logprobs=[-1.0], versions=[0], finished=False
                )
        finally:  # the consumer was cancelled (or closed the generator)
            self.running.discard(request_id)
            self.closed.append(request_id)

    async def load_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version

    async def shutdown(self) -> None:
        return None


@pytest.fixture(scope="session")
def reward_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real reward service on loopback (``retool reward serve``) for rollout integration tests."""
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    with ServiceProcess(["reward", "serve", "--set", "workers=1"], log_path=log) as proc:
        yield proc.url

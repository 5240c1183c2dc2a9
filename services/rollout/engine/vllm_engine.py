"""The vLLM engine adapter (production, GPU): ``AsyncLLM`` in-process behind the ``Engine`` contract.

vLLM is an optional extra (``pip install retool[vllm]``) and is imported lazily: this module
imports without it. Invariants:
- token ids in (``TokensPrompt``), token ids out; stop strings are kept in the output
  (``include_stop_str_in_output``); one log-prob per sampled token (``logprobs=0``);
- prefix caching is on; after every weight swap the prefix cache is reset (cached KV blocks
  were computed by the old weights);
- weights are loaded in place by the worker extension below (``collective_rpc``), which runs in
  the engine core between two scheduler steps, so no forward pass mixes old and new weights.
  The tensors travel to the workers through one safetensors file in shared memory (``/dev/shm``
  when present), not through the RPC's pickled arguments;
- log-probs are vLLM's default ``raw_logprobs`` (before temperature / top-p). At temperature 1,
  the RL setting, they equal the transformers engine's (``log_softmax(logits / T)``);
- version tags: a token gets the version current when its output reaches this process. Where vLLM
  supports ``pause_generation(mode="keep")`` the swap happens with requests frozen (outputs of
  earlier steps are delivered before the pause returns), so the tags are exact; with older vLLM a
  token sampled in the last step before a swap but delivered after it may carry the new version.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import torch

from services.rollout.engine.base import FinishReason, GenerationChunk, SamplingParams

WORKER_EXTENSION = "services.rollout.engine.vllm_engine.RetoolWorkerExtension"


class RetoolWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); called through ``collective_rpc``."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def retool_load_weights(self, path: str) -> int:
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.model_runner.model.load_weights(weights=((n, f.get_tensor(n)) for n in names))
        return len(names)


def to_chunk(output: Any, version: int) -> GenerationChunk:
    """A vLLM ``CompletionOutput`` (delta mode) as a ``GenerationChunk``."""
    token_ids = list(output.token_ids)
    logprobs: list[float] = []
    for tok, entry in zip(token_ids, output.logprobs or [], strict=False):
        logprobs.append(float(entry[tok].logprob))
    if len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned fewer log-probs than tokens (logprobs=0 must be requested)")
    reason: FinishReason | None = None
    stop_str = None
    if output.finish_reason == "length":
        reason = "length"
    elif output.finish_reason == "abort":
        reason = "abort"
    elif output.finish_reason == "stop":
        if isinstance(output.stop_reason, str):
            reason, stop_str = "stop", output.stop_reason
        else:  # None: the EOS token; an int: a stop token id, which we only use for EOS ids
            reason = "eos"
    return GenerationChunk(index=int(output.index), token_ids=token_ids, logprobs=logprobs,
                           versions=[version] * len(token_ids), finished=reason is not None,
                           finish_reason=reason, stop_str=stop_str)


class VLLMEngine:
    """``Engine`` over vLLM's ``AsyncLLM``; ``engine_kwargs`` go to ``AsyncEngineArgs``."""

    def __init__(self, model_dir: str | Path, *, version: int = 0, **engine_kwargs: Any) -> None:
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise RuntimeError(
                "engine: vllm is not installed (pip install 'retool[vllm]', GPU only)") from exc
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        args = AsyncEngineArgs(model=self.model_dir, enable_prefix_caching=True,
                               worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)
        self.llm = AsyncLLM.from_engine_args(args)
        self._version = version
        self._swap_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        vparams = VSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=params.seed, stop=list(params.stop), include_stop_str_in_output=True, logprobs=0,
            output_kind=RequestOutputKind.DELTA, skip_special_tokens=False,
        )
        finished = 0
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), vparams,
                                               request_id):
                for completion in out.outputs:
                    chunk = to_chunk(completion, self._version)
                    finished += chunk.finished
                    if chunk.token_ids or chunk.finished:
                        yield chunk
        finally:
            if finished < params.n:  # the caller went away: free the sequences in vLLM
                await self.llm.abort(request_id)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors}
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="retool-weights-", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            await asyncio.to_thread(save_file, tensors, path)
            del tensors
            async with self._swap_lock:
                paused = await self._pause()
                try:
                    await self.llm.collective_rpc("retool_load_weights", args=(path,))
                    await self.llm.reset_prefix_cache()
                    self._version = version
                finally:
                    if paused:
                        await self.llm.resume_generation()
        finally:
            Path(path).unlink(missing_ok=True)

    async def _pause(self) -> bool:
        """Freeze in-flight requests (recent vLLM: ``mode="keep"``) so that version tags are exact."""
        pause = getattr(self.llm, "pause_generation", None)
        if pause is None:
            return False
        try:
            await pause(mode="keep", clear_cache=False)
        except TypeError:  # an older vLLM without ``mode``: would abort requests, so do not pause
            return False
        return True

    async def shutdown(self) -> None:
        self.llm.shutdown()

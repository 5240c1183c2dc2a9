"""The SFT run: packed micro-batches on the trainer's FSDP2 stack, checkpoints, resume, HF export.

Invariants
- The loss of an optimizer step is the token mean of ``-log p(token)`` over every loss-mask token
  of the *global* batch: each micro-batch's sum is divided by the batch's total mask tokens and
  multiplied by the data-parallel size (FSDP averages gradients over ranks), so the gradient does
  not depend on how the batch is split over ranks and micro-batches.
- Every rank renders the same data, computes the same batch order and runs the same number of
  forward/backward passes per step (an empty micro-batch runs a zero-weighted pass), so FSDP
  collectives line up.
- A checkpoint holds model, optimizer, RNG (services/trainer/checkpoint.py) plus epoch, the data
  cursor (next batch of that epoch) and the scheduler; resuming continues at the next step with
  the same batches and learning rates as an uninterrupted run.
- The run ends with a checkpoint of the final step and a Hugging Face directory exported from it
  (services/trainer/export.py) that the rollout service loads.
- Runs as one plain process (no process group, no FSDP) or under torchrun (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from services.trainer.actor import Actor
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.export import export_hf
from services.trainer.fsdp import apply_fsdp2, device_type, init_distributed
from services.trainer.packing import TrainSample, pack, plan_equal_micro_batches, shard_for_ranks
from services.trainer.sft.config import SFTConfig
from services.trainer.sft.data import DataReport, batch_indices, load_samples, steps_per_epoch
from services.trainer.sft.render import Rendered
from services.trainer.sft.schedule import build_scheduler, warmup_steps

__all__ = ["SFTConfig", "SFTRunner", "run_sft"]

log = logging.getLogger("retool.sft")


def to_train_sample(r: Rendered) -> Any:
    ids = torch.tensor(r.input_ids, dtype=torch.long)
    mask = torch.tensor(r.loss_mask, dtype=torch.float32)
    return TrainSample(input_ids=ids, loss_mask=mask, advantages=torch.zeros_like(mask))


def plan_local(lengths: list[int], budget: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches (indices into ``lengths``); the same count on every rank."""
    shards = shard_for_ranks(lengths, world)
    plans = plan_equal_micro_batches([[lengths[i] for i in shard] for shard in shards], budget)
    return [[shards[rank][j] for j in micro] for micro in plans[rank]]


def _clip_grad_norm(module: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


class MetricsFile:
    """JSONL metrics (rank 0 only; appends so a resumed run continues the same file)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"time": time.time(), **record}) + "\n")


class SFTRunner:
    def __init__(self, cfg: SFTConfig) -> None:
        cfg.require_ready()
        self.cfg = cfg
        self.rank, self.world = 0, 1
        self.distributed = False
        self.owns_process_group = False
        self.report: DataReport | None = None
        self.step = 0

    # ---- set-up -----------------------------------------------------------------------------
    def _setup_dist(self) -> Any:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.cfg.validate_parallel(world)
        if world == 1 and not dist.is_initialized():
            return None
        self.owns_process_group = not dist.is_initialized()

        if device_type() == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.rank, self.world, mesh = init_distributed(self.cfg.trainer_view())
        self.distributed = True
        return mesh

    def _setup_model(self, mesh: Any) -> None:
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import AutoModelForCausalLM


        torch.manual_seed(self.cfg.seed)
        lm = AutoModelForCausalLM.from_pretrained(str(self.cfg.model_path), dtype=torch.float32)
        # the loss is -log p on the loss mask alone: no entropy, and the LM head runs on mask positions only
        self.actor = Actor(lm, chunk_tokens=self.cfg.logprob_chunk_tokens, entropy=False)
        self.device = torch.device(device_type())
        self.autocast = False
        if self.distributed:
            apply_fsdp2(self.actor, self.cfg.fsdp, mesh)
        else:
            if self.cfg.fsdp.gradient_checkpointing:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.actor.to(self.device)
            self.autocast = self.cfg.fsdp.param_dtype == "bf16"
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=o.lr, betas=o.betas,
                                           weight_decay=o.weight_decay, foreach=False)

    def _load_data(self) -> None:
        # lazy: transformers adds ~5 s of import and only this function needs it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.cfg.model_path))
        rendered, self.report = load_samples(self.cfg.data, tokenizer, self.cfg.agent)
        self.samples = [to_train_sample(r) for r in rendered]

    def _resume(self, scheduler: Any) -> tuple[int, int, int, Path | None]:
        """(step, epoch, batch cursor, checkpoint) to start from."""
        ck = self.cfg.checkpoint
        path: Path | None = Path(ck.resume_from) if ck.resume_from else None
        if path is None and ck.resume == "auto":
            latest = latest_checkpoint(ck.dir)
            path = latest.path if latest is not None else None
        if path is None:
            return 0, 0, 0, None
        meta = load_checkpoint(path, self.actor, self.optimizer)
        extra = meta.extra
        if extra.get("num_samples") != len(self.samples):
            raise ValueError(f"checkpoint {path} was trained on {extra.get('num_samples')} samples, the data "
                             f"now has {len(self.samples)}: the data cursor would not match")
        scheduler.load_state_dict(extra["scheduler"])
        if self.rank == 0:
            log.info("resumed from %s (step %d, epoch %d, batch %d)", path, meta.step, extra["epoch"],
                     extra["cursor"])
        return meta.step, int(extra["epoch"]), int(extra["cursor"]), path

    def _save(self, step: int, epoch: int, cursor: int, scheduler: Any) -> Path:
        extra = {"epoch": epoch, "cursor": cursor, "num_samples": len(self.samples),
                 "scheduler": scheduler.state_dict()}
        return save_checkpoint(self.cfg.checkpoint.dir, step, self.actor, self.optimizer,
                               keep_last=self.cfg.checkpoint.keep_last, extra=extra)

    # ---- one optimizer step ------------------------------------------------------------------
    def _forward(self, mb: Any) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            lp, _ = self.actor(mb.input_ids.to(self.device), mb.position_ids.to(self.device), None,
                               mb.loss_mask.to(self.device) > 0)
        return lp.float()

    def train_batch(self, batch: list[Any]) -> dict[str, float]:
        num_tokens = float(sum(float(s.loss_mask.sum()) for s in batch))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL needs it on the GPU
        for micro in plan_local([len(s) for s in batch], self.cfg.token_budget, self.rank, self.world):
            if not micro:  # keep FSDP collectives aligned: zero-weighted pass
                (self._forward(pack([batch[0]])).sum() * 0.0).backward()
                continue
            mb = pack([batch[i] for i in micro])
            lp = self._forward(mb)
            nll = -(lp * mb.loss_mask.to(lp.device)).sum()
            (nll / num_tokens * self.world).backward()
            loss_sum += nll.detach().double()
        if self.distributed:
            dist.all_reduce(loss_sum)
        grad_norm = _clip_grad_norm(self.actor, self.cfg.optim.grad_clip)
        self.optimizer.step()
        return {"loss": float(loss_sum) / num_tokens, "grad_norm": grad_norm, "loss_tokens": num_tokens,
                "tokens": float(sum(len(s) for s in batch)), "sequences": float(len(batch))}

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> Path:
        cfg = self.cfg
        mesh = self._setup_dist()
        try:
            self._load_data()
            self._setup_model(mesh)
            assert self.report is not None
            n = len(self.samples)
            per_epoch = steps_per_epoch(n, cfg.batch_size)
            total = per_epoch * cfg.epochs
            if cfg.max_steps is not None:
                total = min(total, cfg.max_steps)
            warm = warmup_steps(total, cfg.optim.warmup_ratio, cfg.optim.warmup_steps)
            scheduler = build_scheduler(self.optimizer, total=total, warmup=warm,
                                        min_lr_ratio=cfg.optim.min_lr_ratio)
            step, epoch, cursor, final = self._resume(scheduler)
            self.step = step
            metrics = MetricsFile(cfg.metrics_path) if self.rank == 0 else None
            if self.rank == 0:
                log.info("%s", self.report.summary())
                log.info("SFT: %d samples, %d steps/epoch, %d steps (%d warm-up), world %d, start at step %d",
                         n, per_epoch, total, warm, self.world, step)
                assert metrics is not None
                metrics.write({"event": "start", "step": step, "total_steps": total, "world_size": self.world,
                               "data": self.report.as_dict()})
            bar = tqdm(total=total, initial=step, desc="sft", disable=self.rank != 0 or not cfg.progress)
            while step < total:
                start = time.perf_counter()
                idx = batch_indices(n, epoch, cursor, cfg.batch_size, cfg.seed, cfg.shuffle)
                lr = self.optimizer.param_groups[0]["lr"]
                out = self.train_batch([self.samples[i] for i in idx])
                scheduler.step()
                step += 1
                cursor += 1
                if cursor >= per_epoch:
                    epoch, cursor = epoch + 1, 0
                self.step = step
                seconds = time.perf_counter() - start
                record = {"step": step, "epoch": epoch + cursor / per_epoch, "lr": lr,
                          "tokens_per_s": out["tokens"] / seconds, "step_seconds": seconds, **out}
                if metrics is not None:
                    metrics.write(record)
                    bar.set_postfix(loss=f"{out['loss']:.4f}", lr=f"{lr:.2e}")
                    log.info("step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f epoch %.2f",
                             step, total, out["loss"], lr, out["grad_norm"], record["tokens_per_s"],
                             record["epoch"])
                bar.update(1)
                if step % cfg.checkpoint.save_freq == 0 or step >= total:
                    final = self._save(step, epoch, cursor, scheduler)
            bar.close()
            if final is None:  # nothing to train and nothing to resume from: export the start weights
                final = self._save(step, epoch, cursor, scheduler)
            if self.distributed:
                dist.barrier()
        finally:
            if self.owns_process_group and dist.is_initialized():
                dist.destroy_process_group()
        out_dir = Path(cfg.output_dir)
        if self.rank == 0:
            export_hf(final, str(cfg.model_path), out_dir)
            if metrics is not None:
                metrics.write({"event": "exported", "step": step, "path": str(out_dir)})
            log.info("exported %s (step %d)", out_dir, step)
        return out_dir


def run_sft(cfg: SFTConfig) -> Path:
    """Train, checkpoint and export; returns the exported Hugging Face directory."""
    return SFTRunner(cfg).run()

"""SFT data: rows of ``messages`` -> rendered samples, length policy, and the epoch/batch order.

Invariants
- Every row is accounted for: used as is, truncated, dropped as too long, or skipped as bad
  (``DataReport``); nothing is removed silently, and a run with no usable sample fails before
  training starts.
- ``truncate`` cuts a sample at ``max_length`` tokens (a cut sample keeps its leading prompt) and
  drops it only if no trainable token is left; ``drop`` removes every sample longer than
  ``max_length``; ``error`` fails naming the first such row.
- The order of epoch ``e`` depends only on (seed, e, number of samples), so a resumed run sees
  the same batches as an uninterrupted one; batch ``b`` of an epoch is ``order[b*B:(b+1)*B]`` (the
  last batch of an epoch may be smaller).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.chat.format import ChatFormat
from services.chat.template_check import TemplateNotAppendOnly, check_append_only
from services.common.config import ConfigError
from services.data.io import iter_rows
from services.trainer.sft.config import SFTDataConfig
from services.trainer.sft.render import Rendered, RenderError, render


@dataclass
class DataReport:
    rows: int = 0
    used: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    tokens: int = 0
    loss_tokens: int = 0
    longest: int = 0

    def add_bad(self, where: str, reason: str) -> None:
        self.bad += 1
        if len(self.bad_examples) < 10:
            self.bad_examples.append(f"{where}: {reason}")

    def summary(self) -> str:
        text = (f"SFT data: {self.rows} rows -> {self.used} samples ({self.truncated} truncated, "
                f"{self.dropped_too_long} dropped as longer than max_length, {self.bad} bad); "
                f"{self.tokens} tokens, {self.loss_tokens} trained, longest {self.longest}")
        return "\n".join([text, *(f"  {b}" for b in self.bad_examples)])

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "bad_examples"}


def _iter_file(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data.train_files: {p} does not exist")
    if p.suffix in (".jsonl", ".json"):
        with p.open() as fh:
            for i, line in enumerate(fh):
                if line.strip():
                    yield i, json.loads(line)
    else:
        yield from iter_rows(p)


def load_samples(cfg: SFTDataConfig, tokenizer: Any, agent: ChatFormat) -> tuple[list[Rendered], DataReport]:
    report = DataReport()
    out: list[Rendered] = []
    if cfg.render == "chat_template":  # before any row: a template that rewrites turns fails here
        try:
            check_append_only(tokenizer, agent)
        except TemplateNotAppendOnly as exc:
            raise ConfigError(f"data.render=chat_template: {exc}") from None
    for path in cfg.train_files:
        for index, row in _iter_file(path):
            if cfg.limit is not None and report.rows >= cfg.limit:
                break
            report.rows += 1
            where = f"{path} row {index}"
            messages = row.get(cfg.messages_key)
            if not isinstance(messages, list):
                report.add_bad(where, f"column {cfg.messages_key!r} is missing or not a list")
                continue
            try:
                sample = render(messages, tokenizer, agent, cfg.render, append_eos=cfg.append_eos)
            except RenderError as exc:
                report.add_bad(where, str(exc))
                continue
            if len(sample) > cfg.max_length:
                if cfg.truncation == "error":
                    raise ConfigError(f"{where} has {len(sample)} tokens > data.max_length={cfg.max_length} "
                                      "(data.truncation=error)")
                if cfg.truncation == "drop":
                    report.dropped_too_long += 1
                    continue
                sample = Rendered(sample.input_ids[:cfg.max_length], sample.loss_mask[:cfg.max_length])
                if not any(sample.loss_mask):
                    report.dropped_too_long += 1
                    continue
                report.truncated += 1
            out.append(sample)
            report.used += 1
            report.tokens += len(sample)
            report.loss_tokens += sum(sample.loss_mask)
            report.longest = max(report.longest, len(sample))
    if not out:
        raise ConfigError("no usable SFT sample: " + report.summary())
    return out, report


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


def steps_per_epoch(n: int, batch_size: int) -> int:
    return -(-n // batch_size)


def batch_indices(n: int, epoch: int, batch: int, batch_size: int, seed: int,
                  shuffle: bool = True) -> list[int]:
    order = epoch_order(n, epoch, seed, shuffle)
    return order[batch * batch_size:(batch + 1) * batch_size]

"""Validation metrics with the reference's names (verl ``process_validation_metrics`` + ``_validate``).

For every problem (grouped by data source and problem id) and every numeric variable
(``acc``, ``reward``): ``mean@N``, ``std@N`` (population std), and for k in 2, 4, 8, … < N plus
k = N: ``best@k/{mean,std}``, ``worst@k/{mean,std}`` and, when predictions exist,
``maj@k/{mean,std}``, each estimated by ``n_bootstrap`` resamples of k of the N responses *with
replacement* (as verl), from a seeded generator. Per-problem values are averaged over the
problems of a source. Names are ``val-core/<source>/<var>/<metric>`` for the core variable
(``acc`` if present, else ``reward``) and metrics ``mean@N``, ``maj@N/mean``, ``best@N/mean`` at the
largest N; everything else is ``val-aux/<source>/<var>/<metric>``. Tool turns are reported over all
samples as ``val-aux/num_turns/{min,max,mean}``. Majority
vote: the most frequent prediction (a response without an answer predicts ``[INVALID]``; ties
-> the one seen first) and the value of its first occurrence (verl ``calc_maj_val``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from services.common.schemas import Group, PromptJob


class ValSample(BaseModel):
    data_source: str
    problem_id: str
    acc: float
    reward: float
    pred: str | None = None
    num_turns: int = 0


NO_ANSWER = "[INVALID]"  # the pred of a response without an extractable answer (DAPO's compute_score)


def val_samples(jobs: Sequence[PromptJob], groups: Sequence[Group]) -> list[ValSample]:
    """One sample per response; ``groups[i]`` answers ``jobs[i]``; no reward = incorrect, reward 0."""
    return [
        ValSample(data_source=job.data_source or "val", problem_id=job.job_id, acc=float(bool(t.correct)),
                  reward=float(t.reward or 0.0), pred=t.extracted if t.extracted is not None else NO_ANSWER,
                  num_turns=t.turns)
        for job, group in zip(jobs, groups, strict=True)
        for t in group.trajectories
    ]


def bootstrap_ks(n: int) -> list[int]:
    """2, 4, 8, … (< n) then n; empty for n <= 1."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def majority_value(preds: Sequence[str], vals: Sequence[float]) -> float:
    counts: dict[str, int] = {}
    first_val: dict[str, float] = {}
    for p, v in zip(preds, vals, strict=True):
        counts[p] = counts.get(p, 0) + 1
        first_val.setdefault(p, v)
    best = max(counts, key=lambda p: counts[p])  # dict order: first seen wins ties
    return first_val[best]


def bootstrap(
    n_items: int, k: int, reducers: Sequence[Callable[[np.ndarray], float]], *, n_bootstrap: int, seed: int
) -> list[tuple[float, float]]:
    """For each reducer, mean and std over ``n_bootstrap`` index resamples of size k (with replacement)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_items, size=(n_bootstrap, k))
    out = []
    for fn in reducers:
        vals = np.array([fn(row) for row in idx], dtype=np.float64)
        out.append((float(vals.mean()), float(vals.std())))
    return out


def problem_metrics(vals: Sequence[float], preds: Sequence[str] | None, *, n_bootstrap: int, seed: int
                    ) -> dict[str, float]:
    arr = np.asarray(vals, dtype=np.float64)
    n = len(arr)
    metric: dict[str, float] = {f"mean@{n}": float(arr.mean())}
    if n <= 1:
        return metric
    metric[f"std@{n}"] = float(arr.std())
    reducers: list[Callable[[np.ndarray], float]] = [lambda ix: float(arr[ix].max()),
                                                     lambda ix: float(arr[ix].min())]
    if preds is not None:
        plist = list(preds)
        reducers.append(lambda ix: majority_value([plist[i] for i in ix], [float(arr[i]) for i in ix]))
    for k in bootstrap_ks(n):
        res = bootstrap(n, k, reducers, n_bootstrap=n_bootstrap, seed=seed)
        metric[f"best@{k}/mean"], metric[f"best@{k}/std"] = res[0]
        metric[f"worst@{k}/mean"], metric[f"worst@{k}/std"] = res[1]
        if preds is not None:
            metric[f"maj@{k}/mean"], metric[f"maj@{k}/std"] = res[2]
    return metric


def _n_of(metric_name: str) -> int:
    return int(metric_name.split("@")[-1].split("/")[0])


def compute_validation_metrics(samples: Sequence[ValSample], *, n_bootstrap: int = 1000, seed: int = 42
                               ) -> dict[str, float]:
    if not samples:
        raise ValueError("no validation samples")
    by_src: dict[str, dict[str, list[ValSample]]] = {}
    for s in samples:
        by_src.setdefault(s.data_source, {}).setdefault(s.problem_id, []).append(s)
    out: dict[str, float] = {}
    for src, problems in by_src.items():
        acc_by_var: dict[str, dict[str, list[float]]] = {}
        for group in problems.values():
            preds = [g.pred for g in group]
            usable = None if any(p is None for p in preds) else [str(p) for p in preds]
            for var in ("acc", "reward"):
                vals = [float(getattr(g, var)) for g in group]
                for name, value in problem_metrics(vals, usable, n_bootstrap=n_bootstrap, seed=seed).items():
                    acc_by_var.setdefault(var, {}).setdefault(name, []).append(value)
        core_var = "acc"
        for var, metric_lists in acc_by_var.items():
            n_max = max(_n_of(name) for name in metric_lists)
            for name, values in metric_lists.items():
                core = (var == core_var and name.startswith(("mean", "maj", "best"))
                        and f"@{n_max}" in name)
                section = "val-core" if core else "val-aux"
                out[f"{section}/{src}/{var}/{name}"] = float(np.mean(values))
    turns = np.array([s.num_turns for s in samples], dtype=np.float64)
    out["val-aux/num_turns/min"] = float(turns.min())
    out["val-aux/num_turns/max"] = float(turns.max())
    out["val-aux/num_turns/mean"] = float(turns.mean())
    return out


def summary(metrics: dict[str, Any]) -> str:
    return "\n".join(f"{k}: {v:.4f}" for k, v in sorted(metrics.items()))

"""Checkpoint → Hugging Face model directory (the reference's "model merger")."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from services.common.files import make_world_readable
from services.trainer.actor import Actor
from services.trainer.checkpoint import load_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.fsdp import build_optimizer


def export_hf(checkpoint: str | Path, base_model: str | Path, out: str | Path) -> Path:
    """Load the checkpoint's weights into the base architecture and save model + tokenizer."""
    # lazy: transformers adds ~5 s of import and only this function needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer


    lm = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    actor = Actor(lm)
    optimizer = build_optimizer(actor, TrainerConfig())
    load_checkpoint(checkpoint, actor, optimizer, restore_rng=False)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    actor.lm.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_model)).save_pretrained(out)
    return make_world_readable(out)  # the containers (uid 10001) read it through a bind mount

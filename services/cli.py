"""The ``retool`` console script: one sub-command group per service and per job.

Invariant: importing this module is cheap (no torch/sympy); heavy imports happen inside the
command that needs them.
"""

from __future__ import annotations

import sys

import typer

from services import demo, model_cli
from services import eval as eval_cli
from services.common.config import ConfigError
from services.data import cli as data_cli
from services.reward import cli as reward_cli
from services.rollout import cli as rollout_cli
from services.sandbox import cli as sandbox_cli
from services.stack import secrets_cli
from services.trainer import cli as trainer_cli
from services.trainer.sft import cli as sft_cli

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="ReTool: RL post-training with a code-interpreter tool, as services.")


def _register() -> None:
    app.add_typer(sandbox_cli.app, name="sandbox", help="Sandboxed Python execution service.")
    app.add_typer(reward_cli.app, name="reward", help="Math answer grading service.")
    app.add_typer(rollout_cli.app, name="rollout", help="Tool-using rollout service and weight push.")
    app.add_typer(trainer_cli.app, name="trainer", help="RL training (GRPO/DAPO, PPO) under FSDP.")
    app.add_typer(sft_cli.app, name="sft", help="Multi-turn SFT on tool-use traces (FSDP), HF export.")
    app.add_typer(data_cli.app, name="data", help="Prepare DAPO-Math-17k, ReTool-SFT and AIME files.")
    app.add_typer(model_cli.app, name="model", help="Build tiny models and tokenizers locally.")
    app.add_typer(secrets_cli.app, name="secrets", help="Mint the CA, certificates, tokens and Redis ACL.")
    app.command("eval", help="Evaluate a model: mean/maj/best/worst@k, turns, tool use.")(
        eval_cli.eval_command)
    app.command("demo", help="The main job: a tiny model learns by GRPO to use the code tool.")(demo.run)


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except ConfigError as exc:  # raised before anything starts
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

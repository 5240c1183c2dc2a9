"""``retool trainer run | export | ledger``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from services.common.cli_config import config_option, dry_run_option, resolve_config, set_option

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run(
    config: Path = config_option(required=True, help="YAML/JSON run config"),
    set_: list[str] = set_option("trainer.lr=1e-6"),
    dry_run: bool = dry_run_option(),
) -> None:
    """Run RL training (launch under torchrun for more than one process)."""
    # lazy: the loop imports torch (~2.5 s) and redis: not at CLI start
    import asyncio

    from services.common.logging import setup_logging
    from services.trainer.loop import RunConfig, Trainer

    cfg = resolve_config(RunConfig, config=config, env_prefix="RETOOL_TRAINER", overrides=set_,
                         dry_run=dry_run,
                         check=lambda c: c.trainer.validate_parallel(int(os.environ.get("WORLD_SIZE", "1"))))
    if cfg is None:
        return
    setup_logging("INFO")
    steps = asyncio.run(Trainer(cfg).run())
    typer.echo(f"trained to step {steps}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Work, checkpoints and metrics are all written. Skip the interpreter's teardown: with
        # gloo it sometimes aborts ("terminate called without an active exception") after a
        # complete run, and torchrun would report the run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@app.command("export")
def export(
    checkpoint: Path = typer.Option(..., help="checkpoint directory (step_XXXXXXXX)"),
    model: Path = typer.Option(..., help="the Hugging Face model the run started from"),
    out: Path = typer.Option(..., help="output Hugging Face directory"),
) -> None:
    """Write a Hugging Face model from a training checkpoint (the rollout service loads it)."""
    from services.trainer.export import export_hf  # lazy: torch (~2.5 s), not at CLI start

    typer.echo(f"wrote {export_hf(checkpoint, model, out)}")


@app.command("ledger")
def ledger(
    path: Path = typer.Argument(..., help="ledger.jsonl, or the checkpoint directory"),
    print_records: bool = typer.Option(False, "--print", help="print every record, one per line"),
    as_json: bool = typer.Option(False, "--json", help="print the check's report as JSON"),
) -> None:
    """Check the training ledger: every admitted job trained or dropped once, never twice, never lost.

    Exit status 1 when the invariant does not hold (the report names each violation).
    """
    from services.trainer.ledger import LEDGER_FILE, check_file, iter_lines  # lazy: not at CLI start (~20 ms)

    file = path / LEDGER_FILE if path.is_dir() else path
    if not file.is_file():
        raise typer.BadParameter(f"no ledger at {file} (it is written to trainer.checkpoint_dir)",
                                 param_hint="PATH")
    try:
        if print_records:
            for line in iter_lines(file):
                typer.echo(line)
        report = check_file(file)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
    else:
        d = report.as_dict()
        typer.echo(f"steps {d['steps']}  admitted {d['admitted']}  trained {d['trained_groups']}  "
                   f"dropped {d['dropped']}  outstanding {d['outstanding']}")
        typer.echo(f"duplicates ignored {d['duplicates']}  re-issued {d['reissued']}  "
                   f"resumes {d['resumes']}  "
                   f"steps redone {d['steps_redone']}  groups redone {d['groups_redone']}"
                   + ("  (torn last line ignored)" if d["torn_tail"] else ""))
        for v in report.violations:
            typer.echo(f"VIOLATION {v}")
        typer.echo("ledger OK" if report.ok else f"ledger BROKEN: {len(report.violations)} violation(s)")
    if not report.ok:
        raise typer.Exit(1)

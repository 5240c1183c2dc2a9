"""``retool trainer run | export | ledger``."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run(
    config: Path = typer.Option(..., "--config", "-c", help="YAML/JSON run config"),
    set_: list[str] = typer.Option([], "--set", help="override, e.g. --set trainer.lr=1e-6"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved, validated config and exit"),
) -> None:
    """Run RL training (launch under torchrun for more than one process)."""
    import asyncio
    import json
    import os
    import sys

    from services.common.config import load_config
    from services.common.logging import setup_logging
    from services.trainer.loop import RunConfig, Trainer

    cfg = load_config(RunConfig, file=config, env_prefix="RETOOL_TRAINER", overrides=set_)
    cfg.trainer.validate_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    if dry_run:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
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
    from services.trainer.export import export_hf

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
    import json

    from services.trainer.ledger import LEDGER_FILE, check_file, iter_lines

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

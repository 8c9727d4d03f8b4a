"""The operator's own commands: `crds` renders what a cluster needs installed, `operator`
runs the controller (imported only when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kubetune.cli.errors import Abort


@click.command()
@click.option(
    "--out", "outdir", type=click.Path(), default=None, help="Write files here instead of stdout."
)
def crds(outdir: str | None) -> None:
    """Print (or write) the CustomResourceDefinitions."""
    from kubetune.api.crdgen import render_all

    files = render_all()
    if outdir is None:
        click.echo("---\n".join(files.values()))
        return
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        click.echo(f"wrote {out / name}")


@click.command()
@click.option(
    "--namespace", "-n", multiple=True, help="Watch only these namespaces (default: all)."
)
@click.option(
    "--liveness",
    default="http://0.0.0.0:8080/healthz",
    show_default=True,
    help="Liveness endpoint (/healthz); a standby replica answers it too.",
)
@click.option(
    "--log-format",
    type=click.Choice(["plain", "full", "json"]),
    default="full",
    show_default=True,
)
@click.option("--quiet", "-q", "log_level", flag_value="quiet", help="Warnings and errors only.")
@click.option("--verbose", "-v", "log_level", flag_value="verbose", help="Debug logging.")
@click.option("--debug", "-d", "log_level", flag_value="debug", help="Debug logging.")
def operator(
    namespace: tuple[str, ...], liveness: str, log_format: str, log_level: str | None
) -> None:
    """Run the operator (kopf) against the current kubeconfig / in-cluster config.

    One replica runs standalone. With KUBETUNE_LEADER_ELECTION=true several replicas share
    a Lease and only its holder works (docs/operations.md).
    """
    from kubetune.controller.run import configure_logging, run_operator
    from kubetune.controller.settings import leader_settings_from_env

    try:
        settings = leader_settings_from_env()
    except ValueError as exc:
        raise Abort(str(exc)) from exc
    configure_logging(log_format, log_level or "normal")
    sys.exit(run_operator(namespace, liveness, settings))

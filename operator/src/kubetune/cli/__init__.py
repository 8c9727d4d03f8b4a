"""`kubetune` command line: estimate memory, plan jobs offline, render CRDs, run the operator,
and read a cluster's jobs and pools.

This module holds the entry points (`main`, `kubectl_plugin`) and what dispatches to the
commands: the built-in ones of estimate.py, plan.py, cluster.py and operator.py, and those
other distributions register under `kubetune.commands`, each imported only when it runs.
"""

from __future__ import annotations

import importlib.metadata

import click

from kubetune.cli import cluster, estimate, operator, plan
from kubetune.cli.errors import Abort

COMMANDS_ENTRY_POINTS = "kubetune.commands"
"""Entry point group through which other distributions add commands: the local tooling
(dev/, distribution `kubetune-dev`) adds `kubetune dev` and `kubetune demo`."""

_TOOLING_COMMANDS = {
    "dev": "a local control plane with simulated GPU pools",
    "demo": "the end-to-end demo on a local control plane",
}


def _registered() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_ENTRY_POINTS)}


class _Commands(click.Group):
    """The built-in commands plus the registered ones, each imported only when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_registered()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        entry = _registered().get(cmd_name)
        if entry is not None:
            loaded = entry.load()
            if not isinstance(loaded, click.Command):
                raise Abort(f"entry point {entry.value} is not a click command")
            return loaded
        if cmd_name in _TOOLING_COMMANDS:
            return _missing_tooling(cmd_name)
        return None


def _missing_tooling(name: str) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def missing(args: tuple[str, ...]) -> None:
        raise Abort(
            f"`kubetune {name}` ({_TOOLING_COMMANDS[name]}) is part of the local tooling, "
            "which is not installed. To fix: run `make setup` in a kubetune checkout, or "
            "`pip install -e dev` there."
        )

    return missing


@click.group(cls=_Commands)
@click.version_option(package_name="kubetune")
def main() -> None:
    """kubetune: right-sized, cost-aware LLM fine-tuning on Kubernetes."""


for _command in (
    estimate.estimate,
    plan.plan,
    operator.crds,
    cluster.check,
    operator.operator,
    cluster.get_jobs,
    cluster.describe,
    cluster.watch,
    cluster.logs,
    cluster.pools,
):
    main.add_command(_command)


def kubectl_plugin() -> None:
    """`kubectl kubetune ...`: kubectl runs the `kubectl-kubetune` executable it finds on
    PATH with the words after `kubetune` (its own flags before it are not passed on: the
    kubeconfig comes from $KUBECONFIG, or --kubeconfig after the verb)."""
    main(prog_name="kubectl kubetune")

"""`kubetune dev` and `kubetune demo`: the local control plane and the end-to-end demo.

These commands are the local tooling's, not the product's: the `kubetune-dev` distribution
registers them under the `kubetune.commands` entry point group, and the `kubetune` command
line adds whatever is registered there. With only `pip install kubetune`, neither exists.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import yaml

from kubetune.api.crdgen import render_all
from kubetune.cli.errors import Abort
from kubetune.planning.catalog import default_pools

#: Simulated pools of `kubetune dev up`: pool from the built-in catalog → nodes.
SIMULATED_POOLS = {"l40s": 4, "a100-80gb": 4, "h100": 2, "rtx4090-spot": 4}


def simulated_pool_docs() -> list[dict[str, Any]]:
    docs = []
    for pool in default_pools():
        if pool.name in SIMULATED_POOLS:
            doc = pool.to_wire()
            doc["spec"]["maxNodes"] = SIMULATED_POOLS[pool.name]
            docs.append(doc)
    return docs


@click.group()
def dev() -> None:
    """A local control plane with simulated GPU pools (test and demo infrastructure)."""


def _root(root: str | None) -> Path:
    from kubetune_dev.cluster import default_root

    return Path(root) if root else default_root()


@dev.command("up")
@click.option(
    "--root", type=click.Path(), help="State folder (default: ~/.cache/kubetune/dev/default)."
)
@click.option(
    "--pools/--no-pools", default=True, show_default=True, help="Create simulated GPU pools."
)
def dev_up(root: str | None, pools: bool) -> None:
    """Build or find the binaries, start the cluster, install CRDs and simulated pools."""
    from kubetune_dev.binaries import ensure_binaries
    from kubetune_dev.cluster import ClusterError, LocalCluster

    binaries = ensure_binaries(lambda msg: click.echo(msg, err=True))
    cluster = LocalCluster(_root(root), binaries)
    try:
        cluster.start()
        cluster.apply([yaml.safe_load(text) for text in render_all().values()])
        cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")
        if pools:
            cluster.add_simulated_pools(simulated_pool_docs())
    except ClusterError as exc:
        cluster.stop()
        raise Abort(str(exc)) from exc
    click.echo(f"export KUBECONFIG={cluster.kubeconfig}")
    click.echo(f"export PATH={binaries.kubectl.parent}:$PATH", err=True)


@dev.command("down")
@click.option("--root", type=click.Path(), help="State folder of the cluster.")
def dev_down(root: str | None) -> None:
    """Stop every process of the local cluster."""
    from kubetune_dev.cluster import State, stop_processes

    state = State.load(_root(root))
    if state is None:
        click.echo("no local cluster is running")
        return
    names = sorted(state.pids)
    left = stop_processes(state)
    if left:
        raise Abort(f"could not stop: {', '.join(left)}")
    click.echo(f"stopped {len(names)} processes: {', '.join(names)}")


@dev.command("status")
@click.option("--root", type=click.Path(), help="State folder of the cluster.")
def dev_status(root: str | None) -> None:
    """Show which components of the local cluster are running."""
    from kubetune_dev.cluster import State, process_alive

    state = State.load(_root(root))
    if state is None:
        click.echo("no local cluster")
        return
    for name, pid in sorted(state.pids.items()):
        click.echo(f"{name:<26}{pid:>8}  {'running' if process_alive(pid) else 'stopped'}")
    click.echo(f"export KUBECONFIG={Path(state.root) / 'kubeconfig'}")


@click.command()
@click.option(
    "--root", type=click.Path(), help="State folder (default: ~/.cache/kubetune/dev/demo)."
)
@click.option("--keep", is_flag=True, help="Leave the cluster running afterwards.")
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds to wait.")
def demo(root: str | None, keep: bool, timeout: float) -> None:
    """Run examples/tiny-cpu-lora.yaml end to end on a local cluster (trainer on CPU)."""
    from kubetune_dev.cluster import default_root
    from kubetune_dev.demo import run_demo

    code = run_demo(
        Path(root) if root else default_root("demo"),
        keep,
        lambda msg: click.echo(msg, err=False),
        timeout,
    )
    sys.exit(code)

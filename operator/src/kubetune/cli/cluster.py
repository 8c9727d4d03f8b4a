"""The commands that read a cluster through the user's kubeconfig: `check` an installation,
list jobs (`get`) and pools (`pools`), `describe` one job, `watch` it to its end, and print
its trainer's `logs`. readers.py does the reading (imported when a command runs), views.py
and follow.py the text."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from kubetune.api.vocabulary import Phase
from kubetune.cli.errors import Abort
from kubetune.cli.follow import ObjectWatcher, log_sources, outcome
from kubetune.cli.views import describe_job, dump, job_table, pool_table


def _print_objects(objects: list[dict[str, Any]], output: str, as_table: str) -> None:
    if output == "table":
        click.echo(as_table)
    else:
        click.echo(dump({"apiVersion": "v1", "kind": "List", "items": objects}, output))


def _namespace_option(fn: Any) -> Any:
    return click.option(
        "--namespace", "-n", default=None, help="Namespace (default: the context's)."
    )(fn)


def _connection_options(fn: Any) -> Any:
    fn = click.option("--context", default=None, help="Kubeconfig context (default: current).")(fn)
    return click.option("--kubeconfig", default=None, help="Kubeconfig file (default: the usual).")(
        fn
    )


def _cluster_options(fn: Any) -> Any:
    fn = click.option(
        "--output", "-o", type=click.Choice(["table", "json", "yaml"]), default="table",
        show_default=True,
    )(fn)  # fmt: skip
    return _connection_options(fn)


@click.command(name="get")
@_namespace_option
@click.option("--all-namespaces", "-A", is_flag=True, help="Jobs of every namespace.")
@_cluster_options
def get_jobs(
    namespace: str | None, all_namespaces: bool, kubeconfig: str | None, context: str | None,
    output: str,
) -> None:  # fmt: skip
    """List FineTuneJobs: phase, pool, GPUs, progress, ETA, cost spent of the estimate."""
    from kubetune.cli.readers import cluster_jobs

    try:
        jobs, where = cluster_jobs(10.0, kubeconfig, context, namespace, all_namespaces)
    except Exception as exc:  # no kubeconfig, unreachable, forbidden
        raise Abort(f"cannot read FineTuneJobs: {exc}") from exc
    if not jobs and output == "table":
        click.echo(f"no FineTuneJobs in {'any namespace' if where == '*' else where}")
        return
    _print_objects(jobs, output, job_table(jobs, namespaces=all_namespaces))


@click.command()
@click.argument("name")
@_namespace_option
@_cluster_options
def describe(
    name: str, namespace: str | None, kubeconfig: str | None, context: str | None, output: str
) -> None:
    """One FineTuneJob: its plan and the alternatives, memory per GPU, progress, cost,
    checkpoint, recoveries, conditions and recent Events."""
    from lightkube.core.exceptions import ApiError

    from kubetune.cli.readers import job_with_events

    try:
        job, events = job_with_events(10.0, name, kubeconfig, context, namespace)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except Exception as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc}") from exc
    if output == "table":
        click.echo(describe_job(job, events))
    else:
        click.echo(dump(job, output))


@click.command()
@click.argument("name")
@_namespace_option
@click.option(
    "--interval", default=2.0, show_default=True, help="Seconds between looks at the job."
)
@click.option(
    "--timeout", type=float, default=None, help="Give up after this many seconds (exit 2)."
)
@_cluster_options
def watch(
    name: str,
    namespace: str | None,
    interval: float,
    timeout: float | None,
    kubeconfig: str | None,
    context: str | None,
    output: str,
) -> None:
    """Follow a FineTuneJob until it ends: its plan, progress, checkpoints, cost and Events
    as they change (-o json|yaml: the object each time it changes). Exits 0 when it
    succeeds, 1 when it fails, 2 on --timeout."""
    from lightkube.core.exceptions import ApiError

    from kubetune.cli.readers import client, watch_job

    deadline = time.monotonic() + timeout if timeout is not None else None
    try:
        with client(10.0, kubeconfig, context) as api:
            where = namespace or api.namespace or "default"
            watcher = None if output == "table" else ObjectWatcher(output)
            job = watch_job(api, name, where, click.echo, interval, deadline, watcher)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # no kubeconfig, unreachable
        raise Abort(f"cannot read FineTuneJob {name}: {exc}") from exc
    if job is None:
        click.echo(f"still not finished after {timeout:g}s", err=True)
        sys.exit(2)
    status = job.get("status") or {}
    if output == "table":
        message = f": {status['message']}" if status.get("message") else ""
        click.echo(f"{name} {status['phase']}{message}")
    sys.exit(0 if status["phase"] == Phase.SUCCEEDED else 1)


@click.command()
@click.argument("name")
@_namespace_option
@click.option(
    "--attempt", type=int, default=None, help="Which launch of the trainer (default: the latest)."
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="Only this global rank: the pod that runs it, its own lines and those that name no "
    "rank (default: every pod, each line prefixed with attempt and node).",
)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the pods end.")
@click.option("--tail", type=int, default=None, help="Only the last N lines of each pod.")
@_connection_options
def logs(
    name: str,
    namespace: str | None,
    attempt: int | None,
    rank: int | None,
    follow: bool,
    tail: int | None,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Print the trainer's log of a FineTuneJob: one attempt, every node or one rank."""
    from lightkube.core.exceptions import ApiError

    from kubetune.cli.readers import client, stream_logs, trainer_pods
    from kubetune.controller.kube import FineTuneJobResource

    try:
        with client(10.0, kubeconfig, context) as api:
            where = namespace or api.namespace or "default"
            job = api.get(FineTuneJobResource, name, namespace=where).to_dict()  # type: ignore[no-untyped-call]
            status = job.get("status") or {}
            latest = int(status.get("attempt") or 0)
            if latest == 0:
                raise Abort(
                    f"FineTuneJob {name} has not launched a trainer yet (phase "
                    f"{status.get('phase') or Phase.PENDING}): `kubetune watch {name}` follows it"
                )
            wanted = attempt if attempt is not None else latest
            if not 1 <= wanted <= latest:
                raise Abort(f"FineTuneJob {name} has attempts 1 to {latest}, not {wanted}")
            pods = trainer_pods(api, name, where, wanted)
            if not pods:
                raise Abort(
                    f"attempt {wanted} of {name} has no pods "
                    + ("yet" if wanted == latest and not outcome(job) else "left")
                    + ": the operator deletes an attempt's batch Job (and its pods) when it "
                    "stops or replaces it; the trainer's own record of every attempt is "
                    "train-log.jsonl on the checkpoint volume"
                )
            try:
                sources = log_sources(pods, wanted, rank)
            except ValueError as exc:
                raise Abort(str(exc)) from exc
            problems = stream_logs(api, where, sources, click.echo, follow, tail)
    except ApiError as exc:
        raise Abort(f"cannot read FineTuneJob {name}: {exc.status.message}") from exc
    except KeyboardInterrupt:
        sys.exit(130)
    except Abort:
        raise
    except Exception as exc:  # no kubeconfig, unreachable
        raise Abort(f"cannot read the logs of {name}: {exc}") from exc
    if problems:
        raise Abort("\n".join(problems))


@click.command()
@_cluster_options
def pools(kubeconfig: str | None, context: str | None, output: str) -> None:
    """List the cluster's GPUPools: GPU, nodes, free GPUs, price, and whether they are read."""
    from kubetune.cli.readers import pool_objects

    try:
        objects = pool_objects(10.0, kubeconfig, context)
    except Exception as exc:
        raise Abort(f"cannot read GPUPools: {exc}") from exc
    if not objects and output == "table":
        click.echo("no GPUPools: create some (examples/gpupools.yaml, or the chart's gpuPools)")
        return
    _print_objects(objects, output, pool_table(objects))


@click.command()
@click.option(
    "--operator-url",
    default=None,
    help="The operator's metrics endpoint, e.g. http://kubetune-metrics.kubetune-system:8000"
    "/metrics (the chart's `helm test` passes its Service); without it only the CRDs are checked.",
)
@click.option("--timeout", default=10.0, show_default=True, help="Seconds per request.")
def check(operator_url: str | None, timeout: float) -> None:
    """Check an installation: the CRDs are established and the operator answers.

    Uses the current kubeconfig (in a pod: its service account). Exits 1 when anything
    fails, each failure saying what to look at.
    """
    from kubetune.cli.readers import run_checks

    try:
        findings = run_checks(operator_url, timeout)
    except Exception as exc:  # the API server itself: unreachable, forbidden
        raise Abort(f"cannot read the cluster's CRDs: {exc}") from exc
    for finding in findings:
        click.echo(finding.line())
    if not all(f.ok for f in findings):
        sys.exit(1)

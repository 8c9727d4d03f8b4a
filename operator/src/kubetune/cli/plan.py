"""`kubetune plan`: plan a FineTuneJob as the operator would, against the built-in pool
catalog, a file of GPUPools, or (--from-cluster) the cluster's pools and their free GPUs."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from kubetune.api.errors import KubetuneError
from kubetune.api.hints import did_you_mean
from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import FineTuneJob, GPUPool, Objective
from kubetune.cli.errors import Abort
from kubetune.cli.views import dump, hours
from kubetune.control.build.settings import BuildSettings
from kubetune.control.build.storage import single_node
from kubetune.planning.arch import ArchitectureError
from kubetune.planning.catalog import default_pools
from kubetune.planning.estimator import GIB, EstimatorError
from kubetune.planning.planner import Plan, PlannerSettings, plan_job
from kubetune.sources import load_arch
from kubetune_trainer.uris import parse_uri


def _load_yaml_docs(path: str) -> list[dict[str, Any]]:
    """The objects of a YAML file (`-`: stdin), the items of a `List` (what `kubectl get
    -o yaml` prints) included."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise Abort(f"cannot read {_source(path)}: {exc}") from exc
    objects: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise Abort(f"{_source(path)}: expected Kubernetes objects, found {doc!r:.60}")
        if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
            objects.extend(item for item in doc["items"] if isinstance(item, dict))
        else:
            objects.append(doc)
    return objects


def _source(path: str) -> str:
    return "stdin" if path == "-" else path


def load_pools(path: str | None) -> list[GPUPool]:
    if path is None:
        return default_pools()
    pools = []
    for doc in _load_yaml_docs(path):
        if doc.get("kind") != "GPUPool":
            continue
        try:
            pools.append(GPUPool.model_validate(doc))
        except ValidationError as exc:
            name = doc.get("metadata", {}).get("name")
            raise Abort(f"{_source(path)}: GPUPool {name}: {exc}") from exc
    if not pools:
        raise Abort(
            f"{_source(path)} holds no GPUPool objects. To fix: pass a file of GPUPools "
            "(examples/gpupools.yaml), or your cluster's: kubectl get gpupools -o yaml | "
            "kubetune plan JOB.yaml --pools -"
        )
    return pools


def load_jobs(path: str, name: str | None = None) -> list[FineTuneJob]:
    """The FineTuneJobs of `path`, in file order (only the one called `name`, if given), as
    `kubectl apply -f` takes each. A model that is another job of the same file
    (`ftj://<name>`) is planned as that job's model."""
    docs = [d for d in _load_yaml_docs(path) if d.get("kind") == "FineTuneJob"]
    names = [str((d.get("metadata") or {}).get("name")) for d in docs]
    if name is not None and name not in names:
        raise Abort(f"{path}: no FineTuneJob {name!r} (it holds {', '.join(names) or 'none'})")
    if not docs:
        raise Abort(f"{path} holds no FineTuneJob. To fix: pass a file with one (examples/)")
    chosen = [docs[names.index(name)]] if name is not None else docs
    return [_with_upstream(path, _validated_job(path, doc), docs, names) for doc in chosen]


def _with_upstream(
    path: str, job: FineTuneJob, docs: list[dict[str, Any]], names: list[str]
) -> FineTuneJob:
    upstream = parse_uri(job.spec.model.uri).job
    if upstream in names and job.spec.model.architecture is None:
        before = _validated_job(path, docs[names.index(upstream)]).spec.model
        known = before.architecture or (before.uri if parse_uri(before.uri).is_hub else None)
        model = job.spec.model.model_copy(update={"architecture": known})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})
    return job


def _validated_job(path: str, doc: Mapping[str, Any]) -> FineTuneJob:
    try:
        # Field names as the API server takes them: camelCase only.
        return FineTuneJob.model_validate(doc, by_alias=True, by_name=False)
    except ValidationError as exc:
        lines = [f"{path}: invalid FineTuneJob:"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            hint = None
            if err["type"] == "extra_forbidden":
                hint = did_you_mean(err["loc"])
            lines.append(f"  {loc}: {err['msg']}" + (f"; {hint}" if hint else ""))
        raise Abort("\n".join(lines)) from exc


def format_plan(plan: Plan, objective_defaulted: bool = False) -> str:
    """The plan as a table: the chosen configuration (*) and the best of each other pool,
    with each one's memory headroom per GPU; `objective_defaulted`: the job left
    spec.resources.objective unset."""
    c = plan.chosen
    rows = [c, *plan.alternatives]
    width = max(len("POOL"), *(len(r.pool) for r in rows)) + 2
    lines = [
        f"{'':2}{'POOL':<{width}}{'METHOD':<7}{'GPUS':>5}{'NODES':>6}{'SHARD':>8}"
        f"{'MICRO×ACC':>11}{'CKPT':>6}{'GiB/GPU':>9}{'HEADROOM':>10}{'TOK/S':>10}{'TIME':>8}"
        f"{'COST':>11}"
    ]
    for i, r in enumerate(rows):
        mark = "* " if i == 0 else "  "
        used = r.estimate.per_gpu_bytes / GIB
        lines.append(
            f"{mark}{r.pool:<{width}}{r.method:<7}{r.total_gpus:>5}{r.nodes:>6}{r.sharding:>8}"
            f"{f'{r.micro_batch}×{r.grad_accum}':>11}{'on' if r.grad_ckpt else 'off':>6}"
            f"{used:>9.1f}{f'{(r.gpu_memory_gib - used) / r.gpu_memory_gib:.0%}':>10}"
            f"{r.tokens_per_second:>10,.0f}{hours(r.duration_s):>8}{f'${r.cost:,.2f}':>11}"
        )
    lines.append("")
    lines.append(
        f"steps {plan.total_steps:,}, tokens {plan.total_tokens:,}, objective {plan.objective}"
        + (" (the default: the job sets no resources.objective)" if objective_defaulted else "")
        + (" (dataset size assumed: set spec.dataset.totalTokens)" if plan.dataset.assumed else "")
    )
    if c.queued:
        lines.append("capacity: the chosen pool has no free GPUs right now; the job would queue")
    savers = [
        name
        for name, on in (
            ("chunked cross-entropy", c.estimate.setup.chunked_ce),
            ("fused cross-entropy", c.estimate.setup.fused_ce),
            ("activation offloading", c.estimate.setup.activation_offload),
            ("optimizer in backward", c.estimate.setup.optimizer_in_backward),
        )
        if on
    ]
    if savers:
        lines.append(f"memory savers: {', '.join(savers)}")
    lines.append(
        "memory per GPU (GiB): "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in c.estimate.breakdown.items() if v)
    )
    if plan.rejected:
        lines.append("rejected pools:")
        for rejection in plan.rejected:
            lines.append(f"  {rejection.pool}: {rejection.message}")
    return "\n".join(lines)


@click.command()
@click.argument("job_file", type=click.Path(exists=True))
@click.option(
    "--pools",
    "pools_file",
    type=click.Path(exists=True, allow_dash=True),
    help="GPUPools to plan against: a YAML file, or - for stdin (e.g. `kubectl get gpupools "
    "-o yaml`); default: the built-in catalog.",
)
@click.option(
    "--from-cluster",
    is_flag=True,
    help="Plan against the cluster's GPUPools and their free GPUs now (current kubeconfig).",
)
@click.option("--kubeconfig", default=None, help="With --from-cluster: this kubeconfig file.")
@click.option("--context", default=None, help="With --from-cluster: this kubeconfig context.")
@click.option(
    "--safety-factor", type=float, default=PlannerSettings.safety_factor, show_default=True
)
@click.option(
    "--default-objective",
    type=click.Choice(["cost", "time"]),
    default=PlannerSettings.default_objective,
    show_default=True,
    help="Objective of a job without spec.resources.objective (the operator's "
    "KUBETUNE_DEFAULT_OBJECTIVE).",
)
@click.option(
    "--read-write-many",
    is_flag=True,
    help="The checkpoint StorageClass offers ReadWriteMany (the operator's "
    "KUBETUNE_CHECKPOINT_READ_WRITE_MANY): a job with spec.checkpoint.storage.accessMode auto "
    "may span nodes. Without it, as the operator by default, such a job stays on one node.",
)
@click.option("--allow-network", is_flag=True, help="Fetch config.json of unknown hub models.")
@click.option(
    "--output",
    "-o",
    type=click.Choice(["table", "json", "yaml"]),
    default="table",
    show_default=True,
    help="json|yaml: status.plan as the operator would write it (for a file of several "
    "jobs: a mapping of job name to plan).",
)
@click.option("--json", "as_json", is_flag=True, hidden=True, help="The same as -o json.")
@click.option(
    "--job",
    "job_name",
    default=None,
    help="In a file of several FineTuneJobs: the one to plan (default: each, in file order).",
)
def plan(
    job_file: str,
    pools_file: str | None,
    from_cluster: bool,
    kubeconfig: str | None,
    context: str | None,
    safety_factor: float,
    default_objective: Objective,
    read_write_many: bool,
    allow_network: bool,
    output: str,
    as_json: bool,
    job_name: str | None,
) -> None:
    """Plan FineTuneJobs offline: the chosen pool, GPUs, method, time and cost of each."""
    output = "json" if as_json else output
    jobs = load_jobs(job_file, job_name)
    if from_cluster and pools_file:
        raise Abort("--from-cluster and --pools both say where pools come from: pass one")
    if (kubeconfig or context) and not from_cluster:
        raise Abort("--kubeconfig and --context only mean something with --from-cluster")
    unreadable: list[str] = []
    tenant: Tenant | None = None
    tenant_note = ""
    if from_cluster:
        pools, unreadable, tenant, tenant_note = _cluster_pools(
            kubeconfig, context, jobs[0].metadata.get("namespace")
        )
    else:
        pools = load_pools(pools_file)
    settings = PlannerSettings(
        safety_factor=safety_factor,
        default_objective=default_objective,
        # From the cluster, the pools' status says what is free now.
        use_live_capacity=from_cluster,
        tenant=tenant,
    )
    rwx = BuildSettings(checkpoint_read_write_many=read_write_many)
    planned = [(job, *_plan_one(job, pools, settings, rwx, allow_network)) for job in jobs]
    if output != "table":
        wires = {str(j.metadata.get("name")): r.to_status(pools).to_wire() for j, r, _ in planned}
        click.echo(dump(next(iter(wires.values())) if len(wires) == 1 else wires, output))
        return
    for i, (job, result, arch) in enumerate(planned):
        if i:
            click.echo()
        click.echo(f"{job.metadata.get('name', job_file)}: {arch}")
        if i == 0:
            click.echo(_pools_line(pools, pools_file, from_cluster, tenant_note, unreadable))
        click.echo(format_plan(result, objective_defaulted=job.spec.resources.objective is None))


def _pools_line(
    pools: list[GPUPool],
    pools_file: str | None,
    from_cluster: bool,
    tenant_note: str,
    unreadable: list[str],
) -> str:
    """Where the pools planned against come from, in words."""
    if from_cluster:
        lines = [f"pools: {len(pools)} from the cluster, with their free GPUs now{tenant_note}"]
        return "\n".join(lines + [f"  {line}" for line in unreadable])
    if pools_file is None:
        return (
            f"pools: the built-in catalog ({len(pools)} pools, list prices); "
            "--pools or --from-cluster for yours"
        )
    return f"pools: {len(pools)} from {_source(pools_file)}"


def _plan_one(
    job: FineTuneJob,
    pools: list[GPUPool],
    settings: PlannerSettings,
    build: BuildSettings,
    allow_network: bool,
) -> tuple[Plan, str]:
    """One job's plan against `pools` (every pool's best, not only the three runners-up the
    operator records), and its architecture's name."""
    model = job.spec.model.architecture or job.spec.model.uri
    # As the operator decides before the job's checkpoint volume exists.
    held = single_node(job, build, None)
    name = job.metadata.get("name")
    try:
        arch = load_arch(model, allow_network=allow_network)
        result = plan_job(
            job.spec,
            pools,
            arch,
            replace(
                settings,
                single_node_reason=None if held is None else held.reason,
                single_node_fix="" if held is None else held.fix,
            ),
            alternatives=len(pools),
        )
    except (KubetuneError, ArchitectureError, EstimatorError) as exc:
        raise Abort(f"{name}: {exc}" if name else str(exc)) from exc
    return result, arch.name


def _cluster_pools(
    kubeconfig: str | None, context: str | None, namespace: str | None
) -> tuple[list[GPUPool], list[str], Tenant | None, str]:
    """`plan --from-cluster`: the cluster's GPUPools, a line for each one it cannot read, what
    `namespace` allows its jobs (None where the user may not read it), and a note on that."""
    from kubetune.cli.readers import cluster_pools, cluster_tenant

    try:
        pools, unreadable = cluster_pools(10.0, kubeconfig, context)
    except Exception as exc:  # no kubeconfig, unreachable, forbidden
        raise Abort(f"cannot read the cluster's GPUPools: {exc}") from exc
    tenant: Tenant | None = None
    try:
        tenant = cluster_tenant(10.0, kubeconfig, context, namespace)
        tenant_note = f"; for namespace {tenant.name} (pools' namespaceSelectors applied)"
    except Exception as exc:  # e.g. a user who may not read Namespaces
        tenant_note = (
            f"; namespaceSelectors not applied (cannot read namespace "
            f"{namespace or 'of the context'}: {exc})"
        )
    if not pools:
        raise Abort(
            "the cluster has no GPUPool kubetune can read. To fix: create pools "
            "(examples/gpupools.yaml, or the chart's gpuPools)"
            + "".join(f"\n  {line}" for line in unreadable)
        )
    return pools, unreadable, tenant, tenant_note

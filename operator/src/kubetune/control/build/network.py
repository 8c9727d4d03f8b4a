"""The network of a job's trainer pods: the headless Service that gives them stable DNS
names for rendezvous, and the NetworkPolicy that admits only their own job's pods, and on
the metrics port the operator and the metrics scrapers (both one per FineTuneJob; the policy
is left out when the `network_policy` setting is off). docs/trainer-pods.md says why."""

from __future__ import annotations

import json
from typing import Any

from kubetune.api.v1alpha1 import FineTuneJob
from kubetune.api.vocabulary import LABEL_JOB, NAMESPACE_NAME_LABEL
from kubetune.control.build.names import child_names, label_value, metadata, object_meta
from kubetune.control.build.settings import BuildSettings


def build_headless_service(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """DNS for `<job>-<index>.<service>`, published before pods are ready (rendezvous)."""
    name, _, _ = metadata(job)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, child_names(name, 1).service),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: label_value(name)},
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": "rendezvous",
                    "port": settings.rendezvous_port,
                    "targetPort": settings.rendezvous_port,
                    "protocol": "TCP",
                },
                {
                    "name": "metrics",
                    "port": settings.metrics_port,
                    "targetPort": settings.metrics_port,
                    "protocol": "TCP",
                },
            ],
        },
    }


def build_network_policy(job: FineTuneJob, settings: BuildSettings) -> dict[str, Any]:
    """Ingress of the job's trainer pods (every attempt's): from pods of the same job on any
    port (the rendezvous port and the ephemeral ports of NCCL/gloo collectives), and on the
    metrics port from the operator's pods and the `metrics_from` peers. Everything else is
    refused where the CNI enforces NetworkPolicies. Egress is left open: trainers download
    models and data (hub, S3) and resolve names; see docs/trainer-pods.md."""
    name, _, _ = metadata(job)
    same_job = {"podSelector": {"matchLabels": {LABEL_JOB: label_value(name)}}}
    scrapers: list[dict[str, Any]] = []
    if settings.operator_namespace:
        scrapers.append(
            {
                "namespaceSelector": {
                    "matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}
                },
                "podSelector": {"matchLabels": dict(settings.operator_pod_labels)},
            }
        )
    scrapers.extend(json.loads(json.dumps(peer)) for peer in settings.metrics_from)
    ingress: list[dict[str, Any]] = [{"from": [same_job]}]
    if scrapers:
        ingress.append(
            {
                "from": scrapers,
                "ports": [{"protocol": "TCP", "port": settings.metrics_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, child_names(name, 1).network_policy),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: label_value(name)}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }

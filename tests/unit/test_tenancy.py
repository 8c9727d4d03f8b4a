"""What a namespace allows its jobs: label selectors on pools, Secrets by consent."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubetune.api.tenancy import Tenant
from kubetune.api.v1alpha1 import GPUPool, LabelSelector

pytestmark = pytest.mark.unit


def selector(**wire: object) -> LabelSelector:
    return LabelSelector.model_validate(wire)


@pytest.mark.parametrize(
    ("wire", "labels", "matches"),
    [
        ({}, {}, True),  # empty: every namespace
        ({"matchLabels": {"team": "a"}}, {"team": "a", "x": "y"}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "b"}, False),
        ({"matchLabels": {"team": "a"}}, {}, False),
        ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]},
         {"team": "b"}, True),
        ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]},
         {}, True),  # a missing label is not in any set
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "1"}, False),
        ({"matchLabels": {"team": "a"},
          "matchExpressions": [{"key": "tier", "operator": "In", "values": ["prod"]}]},
         {"team": "a", "tier": "dev"}, False),  # every requirement must hold
    ],
)  # fmt: skip
def test_selectors_match_as_kubernetes_does(
    wire: dict[str, object], labels: dict[str, str], matches: bool
) -> None:
    assert selector(**wire).matches(labels) is matches


def test_selectors_describe_themselves_as_kubectl_takes_them() -> None:
    wire = {
        "matchLabels": {"team": "a"},
        "matchExpressions": [
            {"key": "tier", "operator": "NotIn", "values": ["dev", "test"]},
            {"key": "gpu", "operator": "Exists"},
            {"key": "frozen", "operator": "DoesNotExist"},
        ],
    }
    assert selector(**wire).describe() == "team=a,tier notin (dev,test),gpu,!frozen"


@pytest.mark.parametrize(
    ("operator", "values"), [("In", []), ("NotIn", []), ("Exists", ["x"]), ("DoesNotExist", ["x"])]
)
def test_an_expression_whose_values_do_not_fit_its_operator_is_refused(
    operator: str, values: list[str]
) -> None:
    with pytest.raises(ValidationError, match=f"operator {operator}"):
        selector(matchExpressions=[{"key": "k", "operator": operator, "values": values}])


def test_a_pool_without_a_namespace_selector_takes_every_namespace() -> None:
    spec = {"gpu": {"product": "NVIDIA-L4"}, "gpusPerNode": 1, "maxNodes": 1, "pricePerGPUHour": 1}
    pool = GPUPool.model_validate({"metadata": {"name": "l4"}, "spec": spec})
    assert Tenant("anyone").may_use(pool.spec.namespace_selector)
    fenced = GPUPool.model_validate(
        {
            "metadata": {"name": "l4"},
            "spec": {**spec, "namespaceSelector": {"matchLabels": {"t": "a"}}},
        }
    )
    assert not Tenant("anyone").may_use(fenced.spec.namespace_selector)
    assert Tenant.of("a", {"t": "a"}, {}).may_use(fenced.spec.namespace_selector)


def test_secrets_need_the_namespace_owners_consent() -> None:
    tenant = Tenant.of("ml", {}, {"kubetune.io/allowed-secrets": " hf-token ,, s3 "})
    assert tenant.allowed_secrets == {"hf-token", "s3"}
    assert tenant.secret_refusal("hf-token", "spec.model.tokenSecretRef") is None
    refusal = Tenant("ml").secret_refusal("hf-token", "spec.model.tokenSecretRef")
    assert refusal is not None and "(allowed: none)" in refusal
    assert "kubetune.io/allowed-secrets=hf-token`" in refusal

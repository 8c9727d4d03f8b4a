"""Kubernetes quantities read as the API server reads them (lightkube's parser, one wrapper).

The hand-written parser this replaced read `1e9` as no quantity at all; a node's memory or a
claim's size the API server wrote in any of its forms must read as the same number here.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from kubetune.api.units import quantity_value
from kubetune.api.vocabulary import GPU_RESOURCE
from kubetune.control.build.settings import BuildSettings
from kubetune.control.capacity import node_info
from kubetune.controller.settings import settings_from_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e9", Decimal(10**9)),
        ("1Gi", Decimal(2**30)),
        ("500m", Decimal("0.5")),
        ("2.5Ti", Decimal(5 * 2**39)),
        ("200Gi", Decimal(200 * 2**30)),
        ("4", Decimal(4)),
        ("1.5", Decimal("1.5")),
        ("16G", Decimal(16 * 10**9)),
        ("195998420Ki", Decimal(195998420 * 1024)),
    ],
)
def test_a_quantity_is_the_number_kubernetes_reads(text: str, value: Decimal) -> None:
    assert quantity_value(text) == value


@pytest.mark.parametrize("text", ["", "lots", "16GB", "3Qi", "Gi", " 1Gi", "1Gi "])
def test_what_is_no_quantity_says_so(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a Kubernetes quantity: .* such as 4, 500m"):
        quantity_value(text)


def test_a_node_with_memory_in_exponent_form_has_its_memory() -> None:
    node = {
        "metadata": {"name": "n"},
        "status": {
            "allocatable": {"memory": "64e9", GPU_RESOURCE: "1"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert node_info(node).memory_gib == round(64e9 / 2**30, 2)


def test_settings_take_a_quantity_in_exponent_form() -> None:
    settings = settings_from_env({"KUBETUNE_CACHE_SIZE": "5e11"})
    assert settings.build.cache_size == "5e11"
    assert settings.build.cache_max_bytes == int(5e11 * 0.9)
    assert BuildSettings().cache_size == "200Gi"

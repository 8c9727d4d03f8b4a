"""The demo (kubetune_dev.demo) finds the example job it runs in the checkout it comes from."""

from __future__ import annotations

import pytest

from kubetune_dev import demo

pytestmark = pytest.mark.tooling


def test_the_demo_reads_its_example_job_from_the_checkout() -> None:
    job = demo._example_job()
    assert job["kind"] == "FineTuneJob"
    assert job["metadata"]["name"]

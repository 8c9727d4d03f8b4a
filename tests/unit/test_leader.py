"""Leader election without a cluster: the decisions, the next Lease spec, the settings.

The elector against a real API server (conflicts, takeover, release, the watchdog) is
tests/integration/test_lease_election.py; whole replicas failing over,
tests/integration/test_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from kubetune.cli import main
from kubetune.controller import leader
from kubetune.controller.leader import (
    Action,
    LeaderSettings,
    LeadershipLost,
    LeaseElector,
    LeaseRecord,
    decide,
    expired,
    next_spec,
)
from kubetune.controller.run import serve_standby_health
from kubetune.controller.settings import leader_settings_from_env
from kubetune_dev.cluster import free_port

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)


def record(holder: str, duration_s: int = 15, transitions: int = 3) -> LeaseRecord:
    return LeaseRecord(
        holder=holder,
        duration_s=duration_s,
        transitions=transitions,
        renew_time=T0,
        acquire_time=T0,
        resource_version="42",
    )


# ---------------------------------------------------------------------- decisions


def test_no_lease_is_created() -> None:
    assert decide(None, "me", 0.0, 15) is Action.CREATE


def test_our_own_lease_is_renewed_even_when_late() -> None:
    assert decide(record("me"), "me", 0.0, 15) is Action.RENEW
    assert decide(record("me"), "me", 99.0, 15) is Action.RENEW


def test_a_foreign_lease_is_waited_for_until_its_duration_passes() -> None:
    assert decide(record("other"), "me", 0.0, 15) is Action.WAIT
    assert decide(record("other"), "me", 14.9, 15) is Action.WAIT
    assert decide(record("other"), "me", 15.0, 15) is Action.TAKE


def test_the_holders_duration_counts_not_ours() -> None:
    assert decide(record("other", duration_s=30), "me", 20.0, 15) is Action.WAIT
    assert decide(record("other", duration_s=6), "me", 6.0, 15) is Action.TAKE
    # A Lease without a duration falls back to ours.
    assert expired(record("other", duration_s=0), 14.0, 15) is False
    assert expired(record("other", duration_s=0), 15.0, 15) is True


def test_a_released_lease_is_free_at_once() -> None:
    assert expired(record(""), 0.0, 15)
    assert decide(record(""), "me", 0.0, 15) is Action.TAKE


def test_the_sign_of_life_changes_with_each_renewal() -> None:
    a = record("other")
    renewed = LeaseRecord("other", 15, 3, T1, T0, "43")
    taken = LeaseRecord("third", 15, 4, T0, T0, "44")
    assert a.sign_of_life != renewed.sign_of_life != taken.sign_of_life
    # A write that changes nothing of it (say, a label) is no sign of life.
    relabelled = LeaseRecord("other", 15, 3, T0, T0, "45")
    assert a.sign_of_life == relabelled.sign_of_life


def test_next_spec_counts_transitions_and_keeps_the_acquire_time() -> None:
    created = next_spec(None, "me", 15, T0)
    assert (created.holderIdentity, created.leaseTransitions) == ("me", 0)
    assert created.acquireTime == created.renewTime == T0
    taken = next_spec(record("other", transitions=3), "me", 15, T1)
    assert (taken.holderIdentity, taken.leaseTransitions) == ("me", 4)
    assert taken.acquireTime == T1 and taken.renewTime == T1
    renewed = next_spec(record("me", transitions=4), "me", 15, T1)
    assert renewed.leaseTransitions == 4
    assert renewed.acquireTime == T0 and renewed.renewTime == T1
    freed = next_spec(record("", transitions=4), "me", 6, T1)
    assert freed.leaseTransitions == 5 and freed.leaseDurationSeconds == 6


# ---------------------------------------------------------------------- settings


def test_settings_default_off_and_use_the_pod_namespace() -> None:
    s = leader_settings_from_env({"POD_NAMESPACE": "ops", "POD_NAME": "kubetune-abc"})
    assert not s.enabled
    assert (s.lease_name, s.lease_namespace) == ("kubetune", "ops")
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (15, 10.0, 2.0)
    base, suffix = s.identity.rsplit("_", 1)
    assert base == "kubetune-abc" and len(suffix) == 6
    again = leader_settings_from_env({"POD_NAMESPACE": "ops", "POD_NAME": "kubetune-abc"})
    assert again.identity != s.identity, "two processes of one pod must differ"


def test_settings_from_env(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("from-sa\n")
    env = {
        "KUBETUNE_LEADER_ELECTION": "true",
        "KUBETUNE_LEASE_NAME": "kt.leader",
        "KUBETUNE_LEASE_DURATION_SECONDS": "6",
        "KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS": "4",
        "KUBETUNE_LEASE_RETRY_SECONDS": "0.5",
    }
    s = leader_settings_from_env(env, sa_file=sa)
    assert s.enabled and s.lease_name == "kt.leader" and s.lease_namespace == "from-sa"
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (6, 4.0, 0.5)
    s = leader_settings_from_env({**env, "KUBETUNE_LEASE_NAMESPACE": "given"}, sa_file=sa)
    assert s.lease_namespace == "given"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KUBETUNE_LEADER_ELECTION": "maybe"}, "is not true or false"),
        ({"KUBETUNE_LEASE_DURATION_SECONDS": "6.5"}, "whole number of seconds"),
        ({"KUBETUNE_LEASE_DURATION_SECONDS": "0"}, "above zero"),
        ({"KUBETUNE_LEASE_RETRY_SECONDS": "soon"}, "KUBETUNE_LEASE_RETRY_SECONDS='soon'"),
        ({"KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS": "20"}, "the leader must stop before"),
        ({"KUBETUNE_LEASE_RETRY_SECONDS": "10"}, "several tries to renew"),
        ({"KUBETUNE_LEASE_NAME": "Not_A_Name"}, "not a valid object name"),
        ({"KUBETUNE_LEASE_NAMESPACE": "Bad.Namespace"}, "not a namespace name"),
    ],
)
def test_bad_settings_say_how_to_fix_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="To fix") as info:
        leader_settings_from_env({"POD_NAMESPACE": "ops", **env})
    assert message in str(info.value)


def test_leader_election_needs_a_namespace(tmp_path: Path) -> None:
    env = {"KUBETUNE_LEADER_ELECTION": "true"}
    with pytest.raises(ValueError, match="To fix: set KUBETUNE_LEASE_NAMESPACE"):
        leader_settings_from_env(env, sa_file=tmp_path / "absent")
    # Without leader election no namespace is needed.
    assert not leader_settings_from_env({}, sa_file=tmp_path / "absent").enabled


def test_the_operator_command_rejects_bad_settings_before_starting() -> None:
    result = CliRunner().invoke(
        main, ["operator"], env={"KUBETUNE_LEASE_RENEW_DEADLINE_SECONDS": "30"}
    )
    assert result.exit_code == 1
    assert "the leader must stop before a standby may take over" in result.output
    assert "To fix" in result.output


def test_the_peering_option_is_gone() -> None:
    result = CliRunner().invoke(main, ["operator", "--peering"])
    assert result.exit_code == 2
    assert "No such option" in result.output and "--peering" in result.output


# ---------------------------------------------------------------------- the fence


def _settings() -> LeaderSettings:
    return LeaderSettings(enabled=True, lease_namespace="ops", identity="me")


def test_without_leader_election_every_write_is_allowed() -> None:
    leader.install(None)
    assert leader.may_write()
    leader.raise_unless_leader()


def test_a_candidate_that_never_acquired_may_not_write() -> None:
    elector = LeaseElector(None, _settings())  # type: ignore[arg-type]  # never asked
    leader.install(elector)
    try:
        assert not leader.may_write()
        with pytest.raises(LeadershipLost, match="me does not hold the lease ops/kubetune"):
            leader.raise_unless_leader()
    finally:
        leader.install(None)


async def test_a_standby_answers_its_liveness_probe() -> None:
    elector = LeaseElector(None, _settings())  # type: ignore[arg-type]
    elector.holder = "other_123abc"
    url = f"http://127.0.0.1:{free_port()}/healthz"
    runner = await serve_standby_health(url, elector)
    try:

        def get() -> dict[str, str]:
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200
                return dict(json.loads(response.read()))

        body = await asyncio.to_thread(get)
    finally:
        await runner.cleanup()
    assert body == {"role": "standby", "identity": "me", "leader": "other_123abc"}

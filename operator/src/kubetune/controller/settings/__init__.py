"""Operator settings from environment variables (the Helm chart sets them).

Every variable is a row of `SETTINGS` (settings/table.py): the settings objects are built
from it here, and docs/configuration.md lists it with the Helm values that set each one.
A variable that cannot be read stops the operator at start with a "to fix:" message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubetune.control.build.settings import BuildSettings
from kubetune.control.reconcile import ControllerSettings
from kubetune.controller.leader import (
    SERVICE_ACCOUNT_NAMESPACE,
    LeaderSettings,
    default_identity,
    default_namespace,
)
from kubetune.controller.settings.table import SETTINGS, MetricsSettings, Setting
from kubetune.planning.planner import PlannerSettings

__all__ = [
    "SETTINGS",
    "Setting",
    "leader_settings_from_env",
    "metrics_port_from_env",
    "settings_from_env",
]


def _read(group: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The fields of one settings class that the table's variables set, read from `env`."""
    read: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.group != group:
            continue
        default = read[setting.default_from] if setting.default_from else setting.field_default()
        read[setting.env] = fields[setting.name] = setting.parse(env, setting.env, default)
    return fields


def settings_from_env(env: Mapping[str, str] | None = None) -> ControllerSettings:
    env = os.environ if env is None else env
    build = BuildSettings(**_read("build", env))
    planner = PlannerSettings(**_read("planner", env))
    return ControllerSettings(build=build, planner=planner, **_read("controller", env))


def leader_settings_from_env(
    env: Mapping[str, str] | None = None, sa_file: Path = SERVICE_ACCOUNT_NAMESPACE
) -> LeaderSettings:
    """The leader election's settings, checked (`LeaderSettings.validate`); the Lease's
    namespace defaults to the pod's own, and the identity is this process's."""
    env = os.environ if env is None else env
    fields = _read("leader", env)
    fields["lease_namespace"] = fields["lease_namespace"] or default_namespace(env, sa_file)
    return LeaderSettings(**fields, identity=default_identity(env)).validate()


def metrics_port_from_env(env: Mapping[str, str] | None = None) -> int:
    """The operator's /metrics port; 0: any free port, below zero: none."""
    env = os.environ if env is None else env
    return MetricsSettings(**_read("metrics", env)).port

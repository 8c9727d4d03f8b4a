"""`kubetune dev` and `kubetune demo` come from the local tooling's entry points; without the
tooling they say how to get it instead of failing with "No such command"."""

from __future__ import annotations

import importlib.metadata

import pytest
from click.testing import CliRunner

from kubetune import cli

pytestmark = pytest.mark.unit


def test_the_tooling_registers_dev_and_demo() -> None:
    registered = cli._registered()
    assert {"dev", "demo"} <= set(registered)
    assert all(ep.value.startswith("kubetune_dev.") for ep in registered.values())
    result = CliRunner().invoke(cli.main, ["--help"])
    assert result.exit_code == 0
    assert "dev " in result.output and "demo " in result.output


def test_without_the_tooling_the_commands_say_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_registered", lambda: {})
    for args in (["demo", "--keep"], ["dev", "up"]):
        result = CliRunner().invoke(cli.main, args)
        assert result.exit_code == 1, result.output
        assert "part of the local tooling, which is not installed" in result.output
        assert "pip install -e dev" in result.output
    result = CliRunner().invoke(cli.main, ["no-such-command"])
    assert result.exit_code == 2 and "No such command" in result.output


def test_a_registered_command_is_imported_only_when_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded: list[str] = []

    class Entry(importlib.metadata.EntryPoint):
        def load(self) -> object:
            loaded.append(self.name)
            return super().load()

    entry = Entry("demo", "kubetune_dev.cli:demo", cli.COMMANDS_ENTRY_POINTS)
    monkeypatch.setattr(cli, "_registered", lambda: {"demo": entry})
    assert CliRunner().invoke(cli.main, ["--version"]).exit_code == 0
    assert loaded == []
    result = CliRunner().invoke(cli.main, ["demo", "--help"])
    assert result.exit_code == 0 and loaded == ["demo"]

"""The CI's background build of the test tooling (kubetune_dev.prebuild)."""

from __future__ import annotations

import pytest

from kubetune_dev import prebuild

pytestmark = pytest.mark.tooling


def test_builds_what_is_missing_in_order_and_goes_on_past_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[str] = []

    def build(name: str) -> None:
        built.append(name)
        if name == "b":
            raise RuntimeError("no Go toolchain found")

    monkeypatch.setattr(
        prebuild,
        "BUILDS",
        (
            ("a", lambda: False, lambda: build("a")),
            ("b", lambda: False, lambda: build("b")),
            ("cached", lambda: True, lambda: build("cached")),
            ("c", lambda: False, lambda: build("c")),
        ),
    )
    assert prebuild.missing() == ["a", "b", "c"]
    assert prebuild.main([]) == 1
    assert built == ["a", "b", "c"]
    err = capsys.readouterr().err
    assert "b: failed (no Go toolchain found); the tier that needs it will build it again" in err
    assert "cached: cached" in err


def test_ready_says_what_is_missing_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never() -> None:
        raise AssertionError("--ready must build nothing")

    monkeypatch.setattr(
        prebuild, "BUILDS", (("a", lambda: True, never), ("b", lambda: False, never))
    )
    assert prebuild.main(["--ready"]) == 1
    assert "not built yet: b" in capsys.readouterr().err
    monkeypatch.setattr(prebuild, "BUILDS", (("a", lambda: True, never),))
    assert prebuild.main(["--ready"]) == 0

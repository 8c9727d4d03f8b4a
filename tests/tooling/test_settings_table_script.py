"""How hack/settings_table.py renders the operator's table of environment variables, writes it
into a page and checks it (`make docs`; docs/configuration.md's own table is checked by
tests/unit/test_settings_table.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetune.controller.settings import parse
from kubetune.controller.settings.table import Setting
from support.scripts import load_script

pytestmark = pytest.mark.tooling

st = load_script("hack/settings_table.py")

ROWS = (
    Setting(
        "KUBETUNE_POLL_SECONDS",
        "controller.poll_seconds",
        parse.number,
        "how often | a job is read",
        values=("operator.pollSeconds",),
    ),
    Setting(
        "KUBETUNE_ALLOW_NETWORK",
        "controller.allow_network",
        parse.loose_flag,
        "fetch configs",
    ),
    Setting(
        "KUBETUNE_LEASE_NAME",
        "leader.lease_name",
        parse.text,
        "name of the Lease",
        values=("leaderElection.leaseName",),
        chart="`leaderElection.leaseName`; empty: the release's",
    ),
    Setting(
        "KUBETUNE_HF_ENDPOINT",
        "build.hub_endpoint",
        parse.url,
        "a hub mirror",
        default="unset (huggingface.co)",
    ),
)


def test_rows_show_the_fields_defaults_and_how_the_chart_sets_them() -> None:
    assert st.markdown(ROWS).splitlines() == [
        "| variable | default | Helm value | meaning |",
        "| --- | --- | --- | --- |",
        "| `KUBETUNE_POLL_SECONDS` | `30` | `operator.pollSeconds` | how often \\| a job is read |",
        "| `KUBETUNE_ALLOW_NETWORK` | `false` | — | fetch configs |",
        "| `KUBETUNE_LEASE_NAME` | `kubetune` | `leaderElection.leaseName`; empty: the release's "
        "| name of the Lease |",
        "| `KUBETUNE_HF_ENDPOINT` | unset (huggingface.co) | — | a hub mirror |",
    ]


def test_a_default_without_words_for_it_is_an_error() -> None:
    row = Setting("KUBETUNE_HF_ENDPOINT", "build.hub_endpoint", parse.url, "a hub mirror")
    with pytest.raises(ValueError, match="KUBETUNE_HF_ENDPOINT: say its default None"):
        st.markdown([row])


def test_write_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# Configuration\n\nProse.\n\n{st.START}\n| old |\n{st.END}\n\nAfter.\n")

    assert st.main(["--check", str(page)]) == 1
    assert "run `make docs`" in capsys.readouterr().err
    assert st.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith(f"# Configuration\n\nProse.\n\n{st.START}\n| variable |")
    assert text.endswith(f" |\n{st.END}\n\nAfter.\n")
    assert st.main(["--check", str(page)]) == 0

    page.write_text("# A page without markers\n")
    assert st.main(["--check", str(page)]) == 1
    assert "no <!-- settings-table:start -->" in capsys.readouterr().err

"""Unit tests for the control-plane binary builder: go.mod rewriting, versions, cache, envtest."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kubetune_dev import binaries as b

pytestmark = pytest.mark.tooling

UPSTREAM_GOMOD = """\
// This is a generated file. Do not edit directly.

module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tgithub.com/spf13/cobra v1.10.2
\tgo.etcd.io/etcd/client/v3 v3.7.0
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
\tk8s.io/klog/v2 v2.140.0
\tk8s.io/kubectl v0.0.0
)

require (
\tgithub.com/beorn7/perks v1.0.1 // indirect
\tk8s.io/gengo/v2 v2.0.0-20250922181213-ec3ebc5fd46b // indirect
)

exclude github.com/bad/module v1.0.0

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/kubectl => ./staging/src/k8s.io/kubectl
\tk8s.io/sample-cli-plugin => ./staging/src/k8s.io/sample-cli-plugin
)

replace github.com/old/thing v1.2.3 => github.com/new/thing v1.2.4
"""


# --- versions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("v1.37.1", (1, 37, 1)),
        ("1.36.3", (1, 36, 3)),
        ("v1.38.0-rc.0", (1, 38, 0)),
        (" v3.7.3\n", (3, 7, 3)),
    ],
)
def test_parse_semver(text: str, expected: tuple[int, int, int]) -> None:
    assert b.parse_semver(text) == expected


@pytest.mark.parametrize("text", ["", "latest", "v1.37", "x1.2.3"])
def test_parse_semver_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        b.parse_semver(text)


def test_staging_version() -> None:
    assert b.staging_version("v1.37.1") == "v0.37.1"
    assert b.staging_version("1.30.14") == "v0.30.14"
    with pytest.raises(ValueError):
        b.staging_version("v2.0.0")


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Kubernetes v1.31.0\n", "v1.31.0"),
        ("Kubernetes v1.32.4-dispatcher", "v1.32.4"),
        ("Client Version: v1.37.1\nKustomize Version: v5.7.1\n", "v1.37.1"),
        ("no version here", None),
    ],
)
def test_kube_version_from_output(output: str, expected: str | None) -> None:
    assert b.kube_version_from_output(output) == expected


def test_helm_module_follows_major() -> None:
    assert b.helm_module("v4.3.1") == "helm.sh/helm/v4"
    assert b.helm_module("v3.19.0") == "helm.sh/helm/v3"


def test_pins_are_consistent() -> None:
    for pin in (b.KUBERNETES_VERSION, b.ETCD_VERSION, b.KWOK_VERSION, b.HELM_VERSION):
        assert pin.startswith("v")
        b.parse_semver(pin)
    assert b.staging_version(b.KUBERNETES_VERSION).startswith("v0.")


def test_kubernetes_ldflags_stamp_version() -> None:
    flags = b.kubernetes_ldflags("v1.37.1", "2026-10-01T00:00:00Z")
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {pkg}.gitVersion=v1.37.1" in flags
        assert f"-X {pkg}.gitMajor=1" in flags
        assert f"-X {pkg}.gitMinor=37" in flags
        assert f"-X {pkg}.buildDate=2026-10-01T00:00:00Z" in flags
    assert all(" " not in f.removeprefix("-X ") for f in flags)


def test_components_cover_every_binary() -> None:
    comps = b.components("v1.37.1")
    assert tuple(comps) == b.BINARY_NAMES
    assert comps["kube-apiserver"].package == "k8s.io/kubernetes/cmd/kube-apiserver"
    assert comps["kubectl"].version == "v1.37.1"
    assert comps["etcd"].package == b.ETCD_MODULE
    assert comps["helm"].package == f"{b.helm_module()}/cmd/helm"
    assert "-X sigs.k8s.io/kwok/pkg/consts.KubeVersion=1.37.1" in comps["kwok"].ldflags
    # The manifest key changes with the version, so a new pin forces a rebuild.
    assert comps["kube-scheduler"].source != b.components("v1.36.3")["kube-scheduler"].source


# --- go.mod ---------------------------------------------------------------------------------


def test_parse_gomod() -> None:
    mod = b.parse_gomod(UPSTREAM_GOMOD)
    assert mod.module == "k8s.io/kubernetes"
    assert mod.go == "1.26.0"
    assert mod.godebug == ("default=go1.26",)
    assert b.Require("k8s.io/gengo/v2", "v2.0.0-20250922181213-ec3ebc5fd46b", True) in mod.requires
    assert b.Require("github.com/spf13/cobra", "v1.10.2", False) in mod.requires
    assert mod.required_version("k8s.io/api") == "v0.0.0"
    assert mod.excludes == (("github.com/bad/module", "v1.0.0"),)
    local = [r for r in mod.replaces if r.is_local]
    assert [r.old_path for r in local] == [
        "k8s.io/api",
        "k8s.io/client-go",
        "k8s.io/kubectl",
        "k8s.io/sample-cli-plugin",
    ]
    assert b.Replace("github.com/old/thing", "v1.2.3", "github.com/new/thing", "v1.2.4") in (
        mod.replaces
    )


def test_parse_gomod_errors() -> None:
    with pytest.raises(ValueError, match="no module directive"):
        b.parse_gomod("go 1.22\n")
    with pytest.raises(ValueError, match="line 2"):
        b.parse_gomod("module x\nrequire\n")


def test_render_kubernetes_gomod_rewrites_staging() -> None:
    text = b.render_kubernetes_gomod(UPSTREAM_GOMOD, "v1.37.1")
    lines = [line.strip() for line in text.splitlines()]
    assert "module kubetune.local/build/kubernetes" in lines
    assert "go 1.26.0" in lines
    assert "godebug default=go1.26" in lines
    assert "require k8s.io/kubernetes v1.37.1" in lines
    # staging requirements move from v0.0.0 to the published release
    assert "k8s.io/api v0.37.1" in lines
    assert "k8s.io/client-go v0.37.1" in lines
    assert "k8s.io/kubectl v0.37.1" in lines
    assert "v0.0.0" not in text
    # non-staging requirements are copied as they are
    assert "k8s.io/klog/v2 v2.140.0" in lines
    assert "go.etcd.io/etcd/client/v3 v3.7.0" in lines
    assert "github.com/beorn7/perks v1.0.1 // indirect" in lines
    # every staging replace points at the published module
    for name in ("api", "client-go", "kubectl", "sample-cli-plugin"):
        assert f"k8s.io/{name} => k8s.io/{name} v0.37.1" in lines
    assert "./staging" not in text
    # other directives survive
    assert "github.com/old/thing v1.2.3 => github.com/new/thing v1.2.4" in lines
    assert "github.com/bad/module v1.0.0" in lines
    # and it parses back
    again = b.parse_gomod(text)
    assert again.required_version("k8s.io/kubernetes") == "v1.37.1"
    assert not any(r.is_local for r in again.replaces)


def test_render_kubernetes_gomod_rejects_other_modules() -> None:
    with pytest.raises(ValueError, match=r"k8s\.io/kubernetes"):
        b.render_kubernetes_gomod("module example.com/x\n", "v1.37.1")
    odd = UPSTREAM_GOMOD + "replace github.com/x/y => ../y\n"
    with pytest.raises(ValueError, match="unexpected local replace"):
        b.render_kubernetes_gomod(odd, "v1.37.1")


def test_render_module_gomod() -> None:
    upstream = (
        "module go.etcd.io/etcd/server/v3\n\ngo 1.26.0\n\ntoolchain go1.26.10\n\n"
        "require go.etcd.io/etcd/api/v3 v3.7.3\n\n"
        "replace go.etcd.io/etcd/api/v3 => ../api\n"
    )
    text = b.render_module_gomod("etcd", upstream, "go.etcd.io/etcd/server/v3", "v3.7.3")
    mod = b.parse_gomod(text)
    assert mod.module == "kubetune.local/build/etcd"
    assert mod.go == "1.26.0"
    assert mod.requires == (b.Require("go.etcd.io/etcd/server/v3", "v3.7.3"),)
    assert mod.replaces == ()
    with pytest.raises(ValueError):
        b.render_module_gomod("etcd", upstream, "sigs.k8s.io/kwok", "v0.8.0")


# --- cache ----------------------------------------------------------------------------------


def _fake_exe(path: Path, output: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_cache_root_honours_xdg(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert b.cache_root(env) == tmp_path / "kubetune"
    assert b.bin_dir_for("v1.37.1", env) == tmp_path / "kubetune" / "bin" / "k8s-v1.37.1"
    assert b.cache_root({}) == Path.home() / ".cache" / "kubetune"


def test_stamp_only_when_everything_is_built(tmp_path: Path) -> None:
    expected = {"kwok": "sigs.k8s.io/kwok@v0.8.0#x", "helm": "helm.sh/helm/v4@v4.3.1#y"}
    assert not b.is_complete(tmp_path, expected)

    _fake_exe(tmp_path / "kwok")
    b.record_built(tmp_path, "kwok", expected["kwok"])
    with pytest.raises(b.BuildError, match="kwok"):  # its Stage file is missing
        b.write_stamp(tmp_path, {"kwok": expected["kwok"]})
    (tmp_path / b.KWOK_STAGES_NAME).write_text("kind: Stage\n")
    with pytest.raises(b.BuildError, match="helm"):
        b.write_stamp(tmp_path, expected)
    assert not (tmp_path / b.STAMP_NAME).exists()

    _fake_exe(tmp_path / "helm")
    b.record_built(tmp_path, "helm", expected["helm"])
    assert b.read_manifest(tmp_path) == expected
    b.write_stamp(tmp_path, expected)
    assert b.is_complete(tmp_path, expected)

    # a changed pin invalidates the stamp
    assert not b.is_complete(tmp_path, {**expected, "helm": "helm.sh/helm/v4@v4.4.0#y"})
    # a binary deleted behind our back invalidates it too
    (tmp_path / "kwok").unlink()
    assert not b.is_complete(tmp_path, expected)


def test_is_up_to_date(tmp_path: Path) -> None:
    manifest = {"etcd": "go.etcd.io/etcd/server/v3@v3.7.3#a"}
    assert not b.is_up_to_date(tmp_path, "etcd", manifest["etcd"], manifest)  # no file
    exe = _fake_exe(tmp_path / "etcd")
    assert b.is_up_to_date(tmp_path, "etcd", manifest["etcd"], manifest)
    assert not b.is_up_to_date(tmp_path, "etcd", "go.etcd.io/etcd/server/v3@v3.7.4#a", manifest)
    exe.chmod(0o644)
    assert not b.is_up_to_date(tmp_path, "etcd", manifest["etcd"], manifest)


def test_read_manifest_tolerates_garbage(tmp_path: Path) -> None:
    assert b.read_manifest(tmp_path) == {}
    (tmp_path / b.MANIFEST_NAME).write_text("not json")
    assert b.read_manifest(tmp_path) == {}
    (tmp_path / b.MANIFEST_NAME).write_text("[1, 2]")
    assert b.read_manifest(tmp_path) == {}


# --- planning / KUBEBUILDER_ASSETS ----------------------------------------------------------


def test_plan_without_assets_builds_everything(tmp_path: Path) -> None:
    plan = b.make_plan({"XDG_CACHE_HOME": str(tmp_path)})
    assert plan.version == b.KUBERNETES_VERSION
    assert plan.to_build == b.BINARY_NAMES
    assert plan.provided == {}
    assert plan.bin_dir == tmp_path / "kubetune" / "bin" / f"k8s-{b.KUBERNETES_VERSION}"
    bins = plan.binaries()
    assert bins.version == b.KUBERNETES_VERSION
    assert bins.kube_apiserver == plan.bin_dir / "kube-apiserver"
    assert set(bins.as_dict()) == set(b.BINARY_NAMES)
    assert set(plan.expected()) == set(b.BINARY_NAMES)


def test_plan_uses_envtest_assets(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    _fake_exe(assets / "etcd", "etcd Version: 3.5.21")
    _fake_exe(assets / "kube-apiserver", "Kubernetes v1.31.0")
    _fake_exe(assets / "kubectl", "Client Version: v1.31.0")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "KUBEBUILDER_ASSETS": str(assets)}

    plan = b.make_plan(env)  # runs the fake kube-apiserver --version
    assert plan.version == "v1.31.0"
    assert set(plan.provided) == {"etcd", "kube-apiserver", "kubectl"}
    assert plan.to_build == ("kube-controller-manager", "kube-scheduler", "kwok", "helm")
    assert plan.bin_dir == tmp_path / "cache" / "kubetune" / "bin" / "k8s-v1.31.0"
    bins = plan.binaries()
    assert bins.etcd == (assets / "etcd").resolve()
    assert bins.kube_apiserver == (assets / "kube-apiserver").resolve()
    assert bins.kubectl == (assets / "kubectl").resolve()
    assert bins.kube_scheduler == plan.bin_dir / "kube-scheduler"
    assert bins.version == "v1.31.0"
    # the components built next to envtest's apiserver match its version
    assert set(plan.expected()) == set(plan.to_build)
    assert all("v1.31.0" in s for n, s in plan.expected().items() if n.startswith("kube-"))


def test_plan_builds_what_assets_lack(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    _fake_exe(assets / "kube-apiserver", "Kubernetes v1.30.2")
    (assets / "etcd").write_text("not executable")
    env = {"XDG_CACHE_HOME": str(tmp_path), "KUBEBUILDER_ASSETS": str(assets)}
    plan = b.make_plan(env)
    assert set(plan.provided) == {"kube-apiserver"}
    assert "etcd" in plan.to_build and "kubectl" in plan.to_build
    assert plan.version == "v1.30.2"


def test_plan_falls_back_to_pin_when_version_unknown(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    _fake_exe(assets / "kube-apiserver")
    env = {"XDG_CACHE_HOME": str(tmp_path), "KUBEBUILDER_ASSETS": str(assets)}
    plan = b.make_plan(env, detect_version=lambda _path: None)
    assert plan.version == b.KUBERNETES_VERSION
    assert any("could not read the version" in note for note in plan.notes)


def test_plan_rejects_missing_assets_dir(tmp_path: Path) -> None:
    env = {"KUBEBUILDER_ASSETS": str(tmp_path / "nope")}
    with pytest.raises(b.BuildError, match="not a directory"):
        b.make_plan(env)


def test_envtest_binaries_ignores_non_executables(tmp_path: Path) -> None:
    _fake_exe(tmp_path / "etcd")
    (tmp_path / "kubectl").write_text("")
    (tmp_path / "kube-apiserver").mkdir()
    assert set(b.envtest_binaries(tmp_path)) == {"etcd"}


def test_ensure_binaries_fast_path_runs_no_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a complete, stamped cache nothing is built and Go is not even looked for."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    plan = b.make_plan()
    for name, source in plan.expected().items():
        _fake_exe(plan.bin_dir / name)
        b.record_built(plan.bin_dir, name, source)
    (plan.bin_dir / b.KWOK_STAGES_NAME).write_text("kind: Stage\n")
    b.write_stamp(plan.bin_dir, plan.expected())

    def no_go(_env: object) -> str:
        raise AssertionError("Go must not be needed when the cache is complete")

    monkeypatch.setattr(b, "find_go", no_go)
    messages: list[str] = []
    bins = b.ensure_binaries(messages.append)
    assert bins == plan.binaries()
    assert bins.kwok_stages == plan.bin_dir / b.KWOK_STAGES_NAME
    assert messages == []

    # a stale stamp over a complete set of binaries is rewritten, still without Go
    (plan.bin_dir / b.STAMP_NAME).write_text("{}\n")
    assert b.ensure_binaries(messages.append) == plan.binaries()
    assert b.is_complete(plan.bin_dir, plan.expected())

    # losing the Stage file makes kwok count as missing again
    (plan.bin_dir / b.KWOK_STAGES_NAME).unlink()
    assert not b.is_complete(plan.bin_dir, plan.expected())
    assert not b.is_up_to_date(plan.bin_dir, "kwok", plan.expected()["kwok"], plan.expected())


def test_kwok_stages_text(tmp_path: Path) -> None:
    stage = tmp_path / "kustomize" / "stage"
    for sub, names in {
        "node/fast": ["node-initialize.yaml"],
        "node/heartbeat-with-lease": ["node-heartbeat-with-lease.yaml"],
        "pod/fast": ["pod-ready.yaml", "pod-complete.yaml", "pod-delete.yaml"],
    }.items():
        (stage / sub).mkdir(parents=True)
        (stage / sub / "kustomization.yaml").write_text("kind: Kustomization\n")
        for name in names:
            (stage / sub / name).write_text(f"kind: Stage\nmetadata:\n  name: {name[:-5]}\n")
    text = b.kwok_stages_text(tmp_path)
    docs = text.split("---\n")
    assert len(docs) == 5
    assert "Kustomization" not in text
    assert docs[0].startswith("# node/fast/node-initialize.yaml\nkind: Stage")
    assert "name: pod-ready" in text
    (stage / "pod/fast/pod-ready.yaml").unlink()
    (stage / "pod/fast/pod-complete.yaml").unlink()
    (stage / "pod/fast/pod-delete.yaml").unlink()
    with pytest.raises(b.BuildError, match="pod/fast"):
        b.kwok_stages_text(tmp_path)


# --- go environment -------------------------------------------------------------------------


def test_go_environment(tmp_path: Path) -> None:
    env = b.go_environment({"PATH": "/usr/bin", "GOFLAGS": "-tags=foo"}, tmp_path, 2)
    assert env["GOMODCACHE"] == str(tmp_path / "go" / "mod")
    assert env["GOCACHE"] == str(tmp_path / "go" / "build")
    assert env["GOTOOLCHAIN"] == "auto"
    assert env["GOFLAGS"] == "-tags=foo -modcacherw -p=2"
    assert env["CGO_ENABLED"] == "0"
    assert env["GOWORK"] == "off"
    kept = b.go_environment({"GOMODCACHE": "/m", "GOTOOLCHAIN": "local"}, tmp_path, 1)
    assert kept["GOMODCACHE"] == "/m"
    assert kept["GOTOOLCHAIN"] == "local"


def test_build_jobs() -> None:
    assert b.build_jobs({"KUBETUNE_BUILD_JOBS": "3"}) == 3
    assert b.build_jobs({"KUBETUNE_BUILD_JOBS": "0"}) == 1
    assert 1 <= b.build_jobs({}) <= 4


def test_find_go_prefers_env(tmp_path: Path) -> None:
    go = _fake_exe(tmp_path / "go")
    assert b.find_go({"GO": str(go), "PATH": ""}) == str(go)


def test_cli_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    assert b.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(b.bin_dir_for(b.KUBERNETES_VERSION))
    assert os.fspath(tmp_path) in str(b.bin_dir_for(b.KUBERNETES_VERSION))


# --- the S3 server (versitygw) --------------------------------------------------------------


def test_s3_server_component() -> None:
    b.parse_semver(b.VERSITYGW_VERSION)
    comp = b.s3_server_component(build_time="2026-09-04T20:21:34Z")
    assert comp.package == "github.com/versity/versitygw/cmd/versitygw"
    assert comp.version == b.VERSITYGW_VERSION
    assert f"-X main.Version={b.VERSITYGW_VERSION}" in comp.ldflags
    assert "-X main.BuildTime=2026-09-04T20:21:34Z" in comp.ldflags
    assert all(" " not in f.removeprefix("-X ") for f in comp.ldflags)
    # its own recipe is part of its manifest key; the build time is not
    assert comp.source == (
        f"github.com/versity/versitygw@{b.VERSITYGW_VERSION}"
        f"#github.com/versity/versitygw/cmd/versitygw+r{b.BUILD_RECIPE}.{b.S3_SERVER_RECIPE}"
    )
    assert comp.source == b.s3_server_component().source
    assert comp.source != b.s3_server_component("v1.7.0").source
    # the control plane's manifest keys do not change with it (no rebuild of those)
    assert b.components()["etcd"].source == (
        f"{b.ETCD_MODULE}@{b.ETCD_VERSION}#{b.ETCD_MODULE}+r{b.BUILD_RECIPE}"
    )


def test_s3_server_has_a_bin_dir_of_its_own(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    expected = tmp_path / "kubetune" / "bin" / f"versitygw-{b.VERSITYGW_VERSION}"
    assert b.s3_server_dir(env) == expected
    assert b.s3_server_path(env) == b.s3_server_dir(env) / "versitygw"
    assert b.s3_server_dir(env) != b.bin_dir_for(b.KUBERNETES_VERSION, env)
    assert not b.s3_server_ready(env)


def test_ensure_s3_server_fast_path_runs_no_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bin_dir = b.s3_server_dir()
    _fake_exe(bin_dir / "versitygw")
    b.record_built(bin_dir, "versitygw", b.s3_server_component().source)
    b.write_stamp(bin_dir, b.s3_server_expected())

    def no_go(_env: object) -> str:
        raise b.NoGoError("no Go toolchain found")

    monkeypatch.setattr(b, "find_go", no_go)
    messages: list[str] = []
    assert b.ensure_s3_server(messages.append) == bin_dir / "versitygw"
    assert b.s3_server_ready()
    assert messages == []

    # a new recipe makes it stale; rebuilding it needs Go, and its absence is told apart
    monkeypatch.setattr(b, "S3_SERVER_RECIPE", b.S3_SERVER_RECIPE + 1)
    assert not b.s3_server_ready()
    with pytest.raises(b.NoGoError):
        b.ensure_s3_server(messages.append)
    assert issubclass(b.NoGoError, b.BuildError)


FAKE_GO = """\
#!/usr/bin/env python3
import json, os, sys
from pathlib import Path
root = Path(os.environ["FAKE_GO_ROOT"])
args = sys.argv[1:]
with (root / "calls.jsonl").open("a") as log:
    log.write(json.dumps({"args": args, "cwd": os.getcwd()}) + "\\n")
if args[:2] == ["env", "GOVERSION"]:
    print("go1.26.8")
elif args[:3] == ["mod", "download", "-json"]:
    module, version = args[3].split("@")
    (root / "up.mod").write_text(f"module {module}\\n\\ngo 1.25.0\\n")
    (root / "up.info").write_text(json.dumps({"Version": version, "Time": "2026-09-04T20:21:34Z"}))
    print(json.dumps({"Path": module, "Version": version, "GoMod": str(root / "up.mod"),
                      "Info": str(root / "up.info"), "Dir": str(root)}))
elif args[:1] == ["build"]:
    out = Path(args[args.index("-o") + 1])
    out.write_text("#!/bin/sh\\necho versitygw\\n")
    out.chmod(0o755)
else:
    sys.exit(f"unexpected: {args}")
"""


def test_ensure_s3_server_builds_from_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build as it runs go: the release fetched, a wrapper module, the version stamped
    with the release's time, the result recorded and stamped; a second call builds nothing."""
    fake = tmp_path / "fake"
    fake.mkdir()
    go = fake / "go"
    go.write_text(FAKE_GO)
    go.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("GO", str(go))
    monkeypatch.setenv("FAKE_GO_ROOT", str(fake))
    for var in ("GOCACHE", "GOMODCACHE", "GOTMPDIR", "GOFLAGS"):
        monkeypatch.delenv(var, raising=False)
    messages: list[str] = []

    path = b.ensure_s3_server(messages.append)

    assert path == b.s3_server_path() and b.s3_server_ready()
    calls = [json.loads(line) for line in (fake / "calls.jsonl").read_text().splitlines()]
    assert calls[1]["args"] == [
        "mod",
        "download",
        "-json",
        f"github.com/versity/versitygw@{b.VERSITYGW_VERSION}",
    ]
    build = calls[2]["args"]
    assert build[0] == "build" and build[-1] == "github.com/versity/versitygw/cmd/versitygw"
    assert "-trimpath" in build
    ldflags = next(a for a in build if a.startswith("-ldflags="))
    assert "-X main.BuildTime=2026-09-04T20:21:34Z" in ldflags
    assert f"-X main.Version={b.VERSITYGW_VERSION}" in ldflags
    workdir = Path(calls[2]["cwd"])
    assert workdir == b.cache_root() / "work" / f"versitygw-{b.VERSITYGW_VERSION}"
    assert (
        f"require github.com/versity/versitygw {b.VERSITYGW_VERSION}"
        in (workdir / "go.mod").read_text()
    )
    assert b.read_manifest(path.parent) == b.s3_server_expected()
    assert any("versitygw: built in" in m for m in messages)

    assert b.ensure_s3_server(messages.append) == path
    assert len((fake / "calls.jsonl").read_text().splitlines()) == len(calls)


def test_cli_s3_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bin_dir = b.s3_server_dir()
    _fake_exe(bin_dir / "versitygw")
    b.record_built(bin_dir, "versitygw", b.s3_server_component().source)
    b.write_stamp(bin_dir, b.s3_server_expected())
    assert b.main(["s3-server"]) == 0
    assert capsys.readouterr().out.strip() == str(bin_dir / "versitygw")

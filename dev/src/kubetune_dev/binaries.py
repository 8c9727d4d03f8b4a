"""Build, cache and locate the control-plane binaries (and the S3 server) used by the tests.

The integration tier runs a real control plane on loopback: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, with kwok simulating GPU nodes, plus kubectl and helm
for the chart tests. Every binary is compiled from source fetched through the Go module proxy, so
nothing is downloaded from release pages, dl.k8s.io or a container registry.

The versions are pinned below and nowhere else. Binaries land in
``${XDG_CACHE_HOME:-~/.cache}/kubetune/bin/k8s-<version>/`` and are rebuilt only when missing or
when their pin changes. When ``KUBEBUILDER_ASSETS`` points at a setup-envtest directory, its
etcd, kube-apiserver and kubectl are used and only the rest is built (at the Kubernetes version that
directory's kube-apiserver reports).

The tests' S3 server, versitygw (an S3 gateway over a posix directory), is built the same way but
on its own (``ensure_s3_server``), into
``${XDG_CACHE_HOME:-~/.cache}/kubetune/bin/versitygw-<version>/`` with its own manifest, stamp
and lock: it does not depend on the Kubernetes version, and the control plane is neither rebuilt
for it nor needed by it.

Command line::

    python -m kubetune_dev.binaries build      # build what is missing, then print the bin dir
    python -m kubetune_dev.binaries path       # print the bin dir (builds nothing)
    python -m kubetune_dev.binaries versions   # pinned versions and what the built binaries report
    python -m kubetune_dev.binaries s3-server  # build versitygw if missing, print its path

See docs/control-plane-build.md for timings and the flags that start the control plane, and
docs/data.md ("Testing with a local S3 store") for the S3 server.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# --------------------------------------------------------------------------------------------
# Pinned versions: the only place they are set.
# --------------------------------------------------------------------------------------------

#: k8s.io/kubernetes release built for kube-apiserver, -controller-manager, -scheduler, kubectl.
#: Must be a version whose module zip the Go proxy serves (v1.37.2's is refused with 403).
KUBERNETES_VERSION = "v1.37.1"
#: go.etcd.io/etcd/server/v3; Kubernetes 1.37 ships etcd 3.7 (Debian 12's etcd-server is 3.4).
ETCD_VERSION = "v3.7.3"
#: sigs.k8s.io/kwok.
KWOK_VERSION = "v0.8.0"
#: helm.sh/helm/v<major>; the module path follows the major version.
HELM_VERSION = "v4.3.1"

#: github.com/versity/versitygw, the S3 server of the tests (tests/support/s3server.py).
VERSITYGW_VERSION = "v1.8.0"

#: Bump when the build recipe (flags, ldflags) changes so cached binaries are rebuilt.
BUILD_RECIPE = 1
#: Bump when versitygw's own recipe (its ldflags) changes: rebuilds it, not the control plane.
S3_SERVER_RECIPE = 1

# --------------------------------------------------------------------------------------------

KUBERNETES_MODULE = "k8s.io/kubernetes"
ETCD_MODULE = "go.etcd.io/etcd/server/v3"
KWOK_MODULE = "sigs.k8s.io/kwok"
VERSITYGW_MODULE = "github.com/versity/versitygw"
S3_SERVER_NAME = "versitygw"

#: Every binary, in build order (the Kubernetes ones first: they share most of the build cache).
BINARY_NAMES: tuple[str, ...] = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "etcd",
    "kwok",
    "helm",
)
KUBERNETES_COMMANDS: tuple[str, ...] = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
)
#: What a setup-envtest (KUBEBUILDER_ASSETS) directory provides.
ENVTEST_NAMES: tuple[str, ...] = ("etcd", "kube-apiserver", "kubectl")

#: kwok does nothing without Stage objects; the "fast" set the kwok module publishes
#: (kustomize/stage/fast: node initialisation, lease heartbeats, fast pod lifecycle) is copied
#: next to the binary, so stages and binary always come from the same release.
KWOK_STAGES_NAME = "kwok-stages.yaml"
KWOK_STAGE_DIRS: tuple[str, ...] = ("node/fast", "node/heartbeat-with-lease", "pod/fast")
#: Files that must exist for a binary to count as built, besides the binary itself.
EXTRA_ARTIFACTS: dict[str, tuple[str, ...]] = {"kwok": (KWOK_STAGES_NAME,)}

STAMP_NAME = ".complete"
MANIFEST_NAME = ".manifest.json"
LOCK_NAME = ".lock"
HEARTBEAT_SECONDS = 30.0
TAIL_LINES = 40

Progress = Callable[[str], None]

_SEMVER_RE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
_KUBE_VERSION_RE = re.compile(r"\bv(\d+)\.(\d+)\.(\d+)")


class BuildError(RuntimeError):
    """A binary could not be built or located; the message says which and why."""


class NoGoError(BuildError):
    """No Go toolchain to build with (as opposed to a build that was tried and failed)."""


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------


def parse_semver(text: str) -> tuple[int, int, int]:
    """``"v1.37.1"`` (or ``"1.37.1"``, ``"v1.37.1-rc.0"``) -> ``(1, 37, 1)``."""
    m = _SEMVER_RE.match(text.strip())
    if m is None:
        raise ValueError(f"not a semantic version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def staging_version(kube_version: str) -> str:
    """Version of the published staging modules for a release: ``v1.37.1`` -> ``v0.37.1``."""
    major, minor, patch = parse_semver(kube_version)
    if major != 1:
        raise ValueError(f"unexpected Kubernetes major version in {kube_version!r}")
    return f"v0.{minor}.{patch}"


def kube_version_from_output(text: str) -> str | None:
    """The ``vX.Y.Z`` core of a ``--version`` output such as ``Kubernetes v1.31.0``."""
    m = _KUBE_VERSION_RE.search(text)
    if m is None:
        return None
    return f"v{m.group(1)}.{m.group(2)}.{m.group(3)}"


def helm_module(helm_version: str = HELM_VERSION) -> str:
    major = parse_semver(helm_version)[0]
    return "helm.sh/helm" if major < 2 else f"helm.sh/helm/v{major}"


# --------------------------------------------------------------------------------------------
# go.mod handling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Require:
    path: str
    version: str
    indirect: bool = False


@dataclass(frozen=True)
class Replace:
    old_path: str
    old_version: str | None
    new_path: str
    new_version: str | None  # None: the target is a local directory

    @property
    def is_local(self) -> bool:
        return self.new_version is None


@dataclass(frozen=True)
class GoMod:
    module: str
    go: str | None = None
    godebug: tuple[str, ...] = ()
    requires: tuple[Require, ...] = ()
    replaces: tuple[Replace, ...] = ()
    excludes: tuple[tuple[str, str], ...] = ()

    def required_version(self, path: str) -> str | None:
        for req in self.requires:
            if req.path == path:
                return req.version
        return None


def parse_gomod(text: str) -> GoMod:
    """Parse the directives of a go.mod file that matter for building against it."""
    module = ""
    go: str | None = None
    godebug: list[str] = []
    requires: list[Require] = []
    replaces: list[Replace] = []
    excludes: list[tuple[str, str]] = []
    block: str | None = None

    for lineno, raw in enumerate(text.splitlines(), start=1):
        code, _, comment = raw.partition("//")
        tokens = [t.strip('"') for t in code.split()]
        if not tokens:
            continue
        if block is not None:
            if tokens == [")"]:
                block = None
                continue
            verb, args = block, tokens
        else:
            verb, args = tokens[0], tokens[1:]
            if args == ["("]:
                block = verb
                continue
        try:
            if verb == "module":
                module = args[0]
            elif verb == "go":
                go = args[0]
            elif verb == "godebug":
                godebug.append(" ".join(args))
            elif verb == "require":
                indirect = comment.strip().split(";")[0].strip() == "indirect"
                requires.append(Require(args[0], args[1], indirect))
            elif verb == "exclude":
                excludes.append((args[0], args[1]))
            elif verb == "replace":
                arrow = args.index("=>")
                old, new = args[:arrow], args[arrow + 1 :]
                replaces.append(
                    Replace(
                        old_path=old[0],
                        old_version=old[1] if len(old) > 1 else None,
                        new_path=new[0],
                        new_version=new[1] if len(new) > 1 else None,
                    )
                )
            # toolchain, retract, tool, ignore: irrelevant to a consumer of the module.
        except (IndexError, ValueError) as exc:
            raise ValueError(f"go.mod line {lineno}: cannot parse {raw.strip()!r}") from exc
    if not module:
        raise ValueError("go.mod has no module directive")
    return GoMod(
        module=module,
        go=go,
        godebug=tuple(godebug),
        requires=tuple(requires),
        replaces=tuple(replaces),
        excludes=tuple(excludes),
    )


def _gomod_header(module: str, source: str, upstream: GoMod) -> list[str]:
    lines = [
        f"// Generated by kubetune_dev.binaries from {source}'s go.mod; do not edit.",
        f"module {module}",
        "",
    ]
    if upstream.go:
        lines += [f"go {upstream.go}", ""]
    # godebug in the main module sets the runtime defaults of the binary: keep upstream's.
    lines += [f"godebug {g}" for g in upstream.godebug]
    if upstream.godebug:
        lines.append("")
    return lines


def render_kubernetes_gomod(upstream_text: str, kube_version: str) -> str:
    """go.mod of a wrapper module that builds the commands of ``k8s.io/kubernetes@kube_version``.

    Upstream's go.mod requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0
    and replaces them with ``./staging/src/k8s.io/<name>``, which the published module zip does not
    contain. Here every such replace points at the published ``v0.<minor>.<patch>`` release of the
    module, and the rest of upstream's requirements are copied so that module selection matches
    the upstream build exactly.
    """
    upstream = parse_gomod(upstream_text)
    if upstream.module != KUBERNETES_MODULE:
        raise ValueError(f"expected the go.mod of {KUBERNETES_MODULE}, got {upstream.module}")
    sv = staging_version(kube_version)

    staging: list[str] = []
    kept_replaces: list[Replace] = []
    for rep in upstream.replaces:
        if rep.is_local:
            if not rep.old_path.startswith("k8s.io/") or "staging/" not in rep.new_path:
                raise ValueError(
                    f"unexpected local replace in {KUBERNETES_MODULE}: "
                    f"{rep.old_path} => {rep.new_path}"
                )
            staging.append(rep.old_path)
        else:
            kept_replaces.append(rep)
    staging_set = set(staging)

    lines = _gomod_header(
        "kubetune.local/build/kubernetes", f"{KUBERNETES_MODULE} {kube_version}", upstream
    )
    lines.append(f"require {KUBERNETES_MODULE} {kube_version}")
    lines.append("")
    for indirect in (False, True):
        reqs = [r for r in upstream.requires if r.indirect is indirect]
        if not reqs:
            continue
        lines.append("require (")
        for req in reqs:
            version = sv if req.path in staging_set else req.version
            lines.append(f"\t{req.path} {version}" + (" // indirect" if indirect else ""))
        lines += [")", ""]
    if upstream.excludes:
        lines.append("exclude (")
        lines += [f"\t{path} {version}" for path, version in upstream.excludes]
        lines += [")", ""]
    lines.append("replace (")
    lines += [f"\t{path} => {path} {sv}" for path in staging]
    for rep in kept_replaces:
        old = rep.old_path + (f" {rep.old_version}" if rep.old_version else "")
        lines.append(f"\t{old} => {rep.new_path} {rep.new_version}")
    lines.append(")")
    return "\n".join(lines) + "\n"


def render_module_gomod(name: str, upstream_text: str, module: str, version: str) -> str:
    """go.mod of a wrapper module that builds a command of ``module@version``.

    Equivalent to ``go install pkg@version`` (upstream's local replaces point at sibling modules
    of the same release, which the requirement selects anyway), but with upstream's ``go`` and
    ``godebug`` directives, so the binary gets the same runtime defaults, and an explicit
    output path.
    """
    upstream = parse_gomod(upstream_text)
    if upstream.module != module:
        raise ValueError(f"expected the go.mod of {module}, got {upstream.module}")
    lines = _gomod_header(f"kubetune.local/build/{name}", f"{module} {version}", upstream)
    lines.append(f"require {module} {version}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# What gets built
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    """One binary: the Go module and main package it is built from, and its link flags."""

    name: str
    module: str
    version: str
    package: str
    ldflags: tuple[str, ...] = ()
    recipe: int = 0
    """The binary's own recipe number, on top of BUILD_RECIPE (0: none)."""

    @property
    def source(self) -> str:
        """Recorded in the manifest; a cached binary is reused only if this matches."""
        own = f".{self.recipe}" if self.recipe else ""
        return f"{self.module}@{self.version}#{self.package}+r{BUILD_RECIPE}{own}"


def kubernetes_ldflags(kube_version: str, build_date: str) -> tuple[str, ...]:
    """The version stamps upstream's hack/lib/version.sh sets, so ``--version`` is right."""
    major, minor, _ = parse_semver(kube_version)
    values = {
        "gitVersion": kube_version,
        "gitMajor": str(major),
        "gitMinor": str(minor),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    flags: list[str] = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{key}={value}" for key, value in values.items()]
    return tuple(flags)


def components(
    kube_version: str = KUBERNETES_VERSION, *, build_date: str = "1970-01-01T00:00:00Z"
) -> dict[str, Component]:
    """Every binary keyed by its file name (ldflags need the release's build date)."""
    kube_flags = kubernetes_ldflags(kube_version, build_date)
    result = {
        name: Component(
            name, KUBERNETES_MODULE, kube_version, f"{KUBERNETES_MODULE}/cmd/{name}", kube_flags
        )
        for name in KUBERNETES_COMMANDS
    }
    result["etcd"] = Component("etcd", ETCD_MODULE, ETCD_VERSION, ETCD_MODULE)
    kwok_kube = kube_version.removeprefix("v")
    result["kwok"] = Component(
        "kwok",
        KWOK_MODULE,
        KWOK_VERSION,
        f"{KWOK_MODULE}/cmd/kwok",
        (f"-X {KWOK_MODULE}/pkg/consts.KubeVersion={kwok_kube}",),
    )
    helm = helm_module()
    result["helm"] = Component(
        "helm",
        helm,
        HELM_VERSION,
        f"{helm}/cmd/helm",
        (
            f"-X {helm}/internal/version.version={HELM_VERSION}",
            f"-X {helm}/internal/version.gitTreeState=clean",
        ),
    )
    return {name: result[name] for name in BINARY_NAMES}


def versitygw_ldflags(version: str, build_time: str) -> tuple[str, ...]:
    """The stamps upstream's Makefile sets, so ``versitygw --version`` names the release (the
    module proxy knows no commit: ``Build`` says where the source came from instead)."""
    return (
        f"-X main.Version={version}",
        "-X main.Build=goproxy",
        f"-X main.BuildTime={build_time}",
    )


def s3_server_component(
    version: str = VERSITYGW_VERSION, *, build_time: str = "1970-01-01T00:00:00Z"
) -> Component:
    """versitygw, the tests' S3 server (ldflags need the release's time)."""
    return Component(
        S3_SERVER_NAME,
        VERSITYGW_MODULE,
        version,
        f"{VERSITYGW_MODULE}/cmd/versitygw",
        versitygw_ldflags(version, build_time),
        recipe=S3_SERVER_RECIPE,
    )


# --------------------------------------------------------------------------------------------
# Cache layout, manifest and stamp
# --------------------------------------------------------------------------------------------


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kubetune"


def bin_dir_for(kube_version: str, env: Mapping[str, str] | None = None) -> Path:
    return cache_root(env) / "bin" / f"k8s-{kube_version}"


def s3_server_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where versitygw is built: a bin dir of its own, named after its version."""
    return cache_root(env) / "bin" / f"{S3_SERVER_NAME}-{VERSITYGW_VERSION}"


def s3_server_expected() -> dict[str, str]:
    """The stamp of a complete versitygw bin dir."""
    return {S3_SERVER_NAME: s3_server_component().source}


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def read_manifest(bin_dir: Path) -> dict[str, str]:
    """``{binary name: Component.source}`` of the binaries built so far in ``bin_dir``."""
    try:
        data = json.loads((bin_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def record_built(bin_dir: Path, name: str, source: str) -> None:
    manifest = read_manifest(bin_dir)
    manifest[name] = source
    _write_atomic(bin_dir / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def artifacts_present(bin_dir: Path, name: str) -> bool:
    return is_executable(bin_dir / name) and all(
        (bin_dir / extra).is_file() for extra in EXTRA_ARTIFACTS.get(name, ())
    )


def is_up_to_date(bin_dir: Path, name: str, source: str, manifest: Mapping[str, str]) -> bool:
    return manifest.get(name) == source and artifacts_present(bin_dir, name)


def stamp_text(expected: Mapping[str, str]) -> str:
    return json.dumps(dict(sorted(expected.items())), indent=2) + "\n"


def is_complete(bin_dir: Path, expected: Mapping[str, str]) -> bool:
    """True when the stamp matches ``expected`` and every expected binary is present."""
    try:
        stamp = (bin_dir / STAMP_NAME).read_text()
    except OSError:
        return False
    return stamp == stamp_text(expected) and all(artifacts_present(bin_dir, n) for n in expected)


def write_stamp(bin_dir: Path, expected: Mapping[str, str]) -> None:
    """Mark ``bin_dir`` complete; call only once every expected binary has been built."""
    missing = [n for n in expected if not artifacts_present(bin_dir, n)]
    if missing:
        raise BuildError(f"refusing to stamp {bin_dir}: missing {', '.join(missing)}")
    _write_atomic(bin_dir / STAMP_NAME, stamp_text(expected))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Planning: what to take from KUBEBUILDER_ASSETS, what to build
# --------------------------------------------------------------------------------------------


def envtest_binaries(assets_dir: Path) -> dict[str, Path]:
    """The executables among etcd, kube-apiserver and kubectl in a setup-envtest directory."""
    found: dict[str, Path] = {}
    for name in ENVTEST_NAMES:
        path = assets_dir / name
        if is_executable(path):
            found[name] = path.resolve()
    return found


def apiserver_version(path: Path) -> str | None:
    """The ``vX.Y.Z`` a kube-apiserver binary reports, or None if it cannot be run."""
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return kube_version_from_output(out.stdout + out.stderr)


@dataclass(frozen=True)
class BuildPlan:
    version: str
    bin_dir: Path
    provided: Mapping[str, Path]  # from KUBEBUILDER_ASSETS
    to_build: tuple[str, ...]  # built into bin_dir, in order
    notes: tuple[str, ...] = ()

    def expected(self) -> dict[str, str]:
        comps = components(self.version)
        return {name: comps[name].source for name in self.to_build}

    def paths(self) -> dict[str, Path]:
        return {
            name: self.provided[name] if name in self.provided else self.bin_dir / name
            for name in BINARY_NAMES
        }

    def binaries(self) -> Binaries:
        p = self.paths()
        return Binaries(
            etcd=p["etcd"],
            kube_apiserver=p["kube-apiserver"],
            kube_controller_manager=p["kube-controller-manager"],
            kube_scheduler=p["kube-scheduler"],
            kubectl=p["kubectl"],
            kwok=p["kwok"],
            helm=p["helm"],
            version=self.version,
        )


def make_plan(
    env: Mapping[str, str] | None = None,
    *,
    detect_version: Callable[[Path], str | None] = apiserver_version,
) -> BuildPlan:
    """Decide the Kubernetes version, the bin dir and which binaries must be built."""
    env = os.environ if env is None else env
    provided: dict[str, Path] = {}
    notes: list[str] = []
    version = KUBERNETES_VERSION
    assets = env.get("KUBEBUILDER_ASSETS", "").strip()
    if assets:
        assets_dir = Path(assets).expanduser()
        if not assets_dir.is_dir():
            raise BuildError(f"KUBEBUILDER_ASSETS={assets} is not a directory")
        provided = envtest_binaries(assets_dir)
        lacking = [n for n in ENVTEST_NAMES if n not in provided]
        notes.append(
            f"KUBEBUILDER_ASSETS={assets_dir}: using {', '.join(provided) or 'nothing'}"
            + (f"; building {', '.join(lacking)}" if lacking else "")
        )
        if "kube-apiserver" in provided:
            detected = detect_version(provided["kube-apiserver"])
            if detected is None:
                notes.append(
                    f"could not read the version of {provided['kube-apiserver']}; "
                    f"building the other components at {KUBERNETES_VERSION}"
                )
            else:
                version = detected
    to_build = tuple(n for n in BINARY_NAMES if n not in provided)
    return BuildPlan(
        version=version,
        bin_dir=bin_dir_for(version, env),
        provided=provided,
        to_build=to_build,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------
# Running Go
# --------------------------------------------------------------------------------------------


def find_go(env: Mapping[str, str]) -> str:
    candidates = [
        env.get("GO", ""),
        shutil.which("go", path=env.get("PATH")) or "",
        "/usr/local/go/bin/go",
    ]
    for cand in candidates:
        if cand and is_executable(Path(cand)):
            return cand
    raise NoGoError(
        "no Go toolchain found: install Go (1.21 or newer; newer toolchains are fetched from the "
        "Go module proxy as needed) or set GO=/path/to/go"
    )


def build_jobs(env: Mapping[str, str]) -> int:
    """Packages compiled in parallel: the CPU count, capped at 4 to bound memory."""
    configured = env.get("KUBETUNE_BUILD_JOBS", "").strip()
    if configured:
        try:
            return max(1, int(configured))
        except ValueError:
            raise BuildError(f"KUBETUNE_BUILD_JOBS={configured!r} is not a number") from None
    return max(1, min(os.cpu_count() or 1, 4))


def go_environment(base: Mapping[str, str], root: Path, jobs: int) -> dict[str, str]:
    env = dict(base)
    env.setdefault("GOMODCACHE", str(root / "go" / "mod"))
    env.setdefault("GOCACHE", str(root / "go" / "build"))
    # Fetch a newer Go from the module proxy when a go.mod asks for one.
    env.setdefault("GOTOOLCHAIN", "auto")
    env["GOFLAGS"] = " ".join([*base.get("GOFLAGS", "").split(), "-modcacherw", f"-p={jobs}"])
    env["CGO_ENABLED"] = "0"
    env["GOWORK"] = "off"
    env["GO111MODULE"] = "on"
    return env


@dataclass
class _Go:
    go: str
    env: dict[str, str]
    root: Path
    progress: Progress
    logs: Path = field(init=False)

    def __post_init__(self) -> None:
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(
        self, args: Sequence[str], *, cwd: Path, label: str, log_name: str, check: bool = True
    ) -> tuple[int, str]:
        """Run ``go args`` with a heartbeat; unless ``check`` is off, raise on failure with the
        tail of go's output. Returns the exit status and the (combined) output."""
        cmd = [self.go, *args]
        log_path = self.logs / f"{log_name}.log"
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        captured: list[str] = []
        start = time.monotonic()
        with log_path.open("w") as log:
            log.write(f"$ cd {cwd} && {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            assert proc.stdout is not None
            pump = threading.Thread(
                target=_pump, args=(proc.stdout, log, tail, captured), daemon=True
            )
            pump.start()
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=HEARTBEAT_SECONDS)
                        break
                    except subprocess.TimeoutExpired:
                        last = tail[-1] if tail else ""
                        self.progress(
                            f"  ... {label}: {time.monotonic() - start:.0f}s"
                            + (f" (last: {last[:100]})" if last else "")
                        )
            except BaseException:
                _stop(proc)
                raise
            pump.join()
        if rc != 0 and check:
            lines = "\n".join(f"    {line}" for line in tail)
            raise BuildError(
                f"{label} failed: go exited with status {rc}. Last lines of its output:\n"
                f"{lines}\n  full log: {log_path}"
            )
        return rc, "".join(captured)

    def download(self, module: str, version: str, *, label: str) -> dict[str, Any]:
        """``go mod download -json module@version`` (fetches the module zip into GOMODCACHE)."""
        log_name = f"download-{module.replace('/', '_')}-{version}"
        rc, out = self.run(
            ["mod", "download", "-json", f"{module}@{version}"],
            cwd=self.root,
            label=f"{label}: fetching {module}@{version}",
            log_name=log_name,
            check=False,
        )
        try:
            info: dict[str, Any] = json.loads(out[out.index("{") : out.rindex("}") + 1])
        except ValueError:
            info = {"Error": out.strip()[-2000:] or f"go exited with status {rc}"}
        if rc != 0 or info.get("Error"):
            error = str(info.get("Error") or f"go exited with status {rc}")
            hint = ""
            if "403" in error or "not available" in error:
                hint = (
                    "\n  (the Go module proxy does not serve this version; pin another release "
                    "in kubetune_dev/binaries.py)"
                )
            raise BuildError(
                f"{label}: cannot fetch {module}@{version}: {error}{hint}\n"
                f"  full log: {self.logs / (log_name + '.log')}"
            )
        return info


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop go on interrupt or error, letting it remove its temporary work dir first."""
    if proc.poll() is None:
        # Ctrl-C in a terminal already delivered SIGINT to go (same process group); sending it
        # again is harmless and covers the other cases.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def _pump(stream: IO[str], log: IO[str], tail: deque[str], captured: list[str]) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        tail.append(line.rstrip("\n"))
        if len(captured) < 10_000:
            captured.append(line)


def _ensure_file(path: Path, text: str) -> None:
    """Write ``text`` unless already there (so go.sum next to it stays valid)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def kwok_stages_text(kwok_source: Path) -> str:
    """The default kwok Stage objects of a kwok source tree, as one multi-document YAML."""
    root = kwok_source / "kustomize" / "stage"
    docs: list[str] = []
    for sub in KWOK_STAGE_DIRS:
        files = sorted(p for p in (root / sub).glob("*.yaml") if p.name != "kustomization.yaml")
        if not files:
            raise BuildError(f"kwok: no Stage files under {root / sub}")
        for path in files:
            docs.append(f"# {sub}/{path.name}\n" + path.read_text().strip() + "\n")
    return "---\n".join(docs)


def _release_time(info: Mapping[str, Any]) -> str:
    """When the module version was published (the proxy's ``.info``), as RFC 3339."""
    try:
        return str(json.loads(Path(info["Info"]).read_text())["Time"])
    except (KeyError, OSError, ValueError):
        return "1970-01-01T00:00:00Z"


def _build_one(go: _Go, comp: Component, out: Path) -> None:
    label = comp.name
    info = go.download(comp.module, comp.version, label=label)
    upstream = Path(info["GoMod"]).read_text()
    # Stamp the release's date rather than the build's, so builds are reproducible.
    if comp.module == KUBERNETES_MODULE:
        workdir = go.root / "work" / f"kubernetes-{comp.version}"
        gomod = render_kubernetes_gomod(upstream, comp.version)
        comp = components(comp.version, build_date=_release_time(info))[comp.name]
    else:
        workdir = go.root / "work" / f"{comp.name}-{comp.version}"
        gomod = render_module_gomod(comp.name, upstream, comp.module, comp.version)
        if comp.module == VERSITYGW_MODULE:
            comp = s3_server_component(comp.version, build_time=_release_time(info))
    _ensure_file(workdir / "go.mod", gomod)
    tmp = out.with_name(f".{out.name}.partial")
    ldflags = " ".join(["-s", "-w", *comp.ldflags])
    go.run(
        [
            "build",
            "-mod=mod",
            "-trimpath",
            "-v",
            f"-ldflags={ldflags}",
            "-o",
            str(tmp),
            comp.package,
        ],
        cwd=workdir,
        label=f"building {label}",
        log_name=f"build-{comp.name}",
    )
    if comp.name == "kwok":
        _write_atomic(out.parent / KWOK_STAGES_NAME, kwok_stages_text(Path(info["Dir"])))
    os.replace(tmp, out)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of the control-plane binaries, and the Kubernetes version they run."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    version: str

    @property
    def kwok_stages(self) -> Path:
        """Stage objects for ``kwok --config`` (node init, lease heartbeat, pod lifecycle)."""
        return self.kwok.parent / KWOK_STAGES_NAME

    def as_dict(self) -> dict[str, Path]:
        return {
            "etcd": self.etcd,
            "kube-apiserver": self.kube_apiserver,
            "kube-controller-manager": self.kube_controller_manager,
            "kube-scheduler": self.kube_scheduler,
            "kubectl": self.kubectl,
            "kwok": self.kwok,
            "helm": self.helm,
        }


@contextlib.contextmanager
def _locked(bin_dir: Path, progress: Progress) -> Iterator[None]:
    """Serialize builds of one bin dir across processes (parallel test workers, CI steps)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    with (bin_dir / LOCK_NAME).open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process building into {bin_dir} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _say_flushed(progress: Progress) -> Progress:
    def say(msg: str) -> None:
        progress(msg)
        sys.stdout.flush()
        sys.stderr.flush()

    return say


def _build_into(
    bin_dir: Path,
    comps: Mapping[str, Component],
    names: Sequence[str],
    say: Progress,
    *,
    first_note: str,
) -> None:
    """Build those of ``names`` that are missing or stale in ``bin_dir``, then stamp it.

    The caller holds ``bin_dir``'s lock. ``first_note`` is added to the announcement when Go's
    build cache is empty (how long a first build takes).
    """
    expected = {name: comps[name].source for name in names}
    manifest = read_manifest(bin_dir)
    todo = [n for n in names if not is_up_to_date(bin_dir, n, comps[n].source, manifest)]
    if not todo:  # everything is there; only the stamp was stale (e.g. other assets)
        write_stamp(bin_dir, expected)
        return
    root = cache_root()
    go_bin = find_go(os.environ)
    jobs = build_jobs(os.environ)
    env = go_environment(os.environ, root, jobs)
    if "GOTMPDIR" not in os.environ:
        # go leaves its work dir behind when interrupted; keep those under the cache, one
        # dir per bin dir (guarded by its lock), and clear leftovers of earlier runs.
        tmp = root / "tmp" / bin_dir.name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        env["GOTMPDIR"] = str(tmp)
    go = _Go(go_bin, env, root, say)
    first = not (root / "go" / "build").exists() and "GOCACHE" not in os.environ
    go_version = subprocess.run(
        [go_bin, "env", "GOVERSION"], env=go.env, capture_output=True, text=True, check=False
    ).stdout.strip()
    say(
        f"building {', '.join(todo)} into {bin_dir} ({go_version or go_bin}, -p={jobs})"
        + (f"; {first_note}" if first else "")
    )
    total = time.monotonic()
    for i, name in enumerate(todo, start=1):
        comp = comps[name]
        say(f"[{i}/{len(todo)}] {name} ({comp.module} {comp.version})")
        start = time.monotonic()
        _build_one(go, comp, bin_dir / name)
        record_built(bin_dir, name, comp.source)
        size = (bin_dir / name).stat().st_size / 2**20
        say(f"[{i}/{len(todo)}] {name}: built in {time.monotonic() - start:.0f}s ({size:.0f} MiB)")
    write_stamp(bin_dir, expected)
    say(f"all binaries ready in {time.monotonic() - total:.0f}s: {bin_dir}")


def ensure_binaries(progress: Progress = print) -> Binaries:
    """Return the control-plane binaries, building (once, then cached) whatever is missing."""
    say = _say_flushed(progress)
    plan = make_plan()
    expected = plan.expected()
    if is_complete(plan.bin_dir, expected):
        return plan.binaries()

    with _locked(plan.bin_dir, say):
        if is_complete(plan.bin_dir, expected):  # another process finished it meanwhile
            return plan.binaries()
        for note in plan.notes:
            say(note)
        _build_into(
            plan.bin_dir,
            components(plan.version),
            plan.to_build,
            say,
            first_note="a first build takes about 10 minutes on 2 cores",
        )
    return plan.binaries()


def s3_server_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the versitygw binary is (or will be once built)."""
    return s3_server_dir(env) / S3_SERVER_NAME


def s3_server_ready(env: Mapping[str, str] | None = None) -> bool:
    """Whether versitygw is built, stamped and current (``ensure_s3_server`` would not build)."""
    return is_complete(s3_server_dir(env), s3_server_expected())


def ensure_s3_server(progress: Progress = print) -> Path:
    """Return the path of versitygw, the tests' S3 server, building it (once, then cached)
    when missing or when its pin or recipe changed. Raises NoGoError when it has to be built
    and there is no Go, BuildError when the build fails."""
    say = _say_flushed(progress)
    bin_dir = s3_server_dir()
    if s3_server_ready():
        return s3_server_path()
    with _locked(bin_dir, say):
        if not s3_server_ready():  # or another process finished it meanwhile
            _build_into(
                bin_dir,
                {S3_SERVER_NAME: s3_server_component()},
                (S3_SERVER_NAME,),
                say,
                first_note="a first build takes about 2 minutes on 2 cores",
            )
    return s3_server_path()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_VERSION_ARGS: dict[str, tuple[str, ...]] = {
    "kubectl": ("version", "--client"),
    "helm": ("version", "--short"),
}


def reported_version(path: Path, name: str) -> str:
    args = _VERSION_ARGS.get(name, ("--version",))
    try:
        out = subprocess.run(
            [str(path), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(cannot run: {exc})"
    text = (out.stdout or out.stderr).strip()
    return " | ".join(line.strip() for line in text.splitlines()[:2]) or f"(exit {out.returncode})"


def _cmd_versions() -> int:
    print(f"kubernetes  {KUBERNETES_VERSION}  ({KUBERNETES_MODULE})")
    print(f"etcd        {ETCD_VERSION}  ({ETCD_MODULE})")
    print(f"kwok        {KWOK_VERSION}  ({KWOK_MODULE})")
    print(f"helm        {HELM_VERSION}  ({helm_module()})")
    print(f"versitygw   {VERSITYGW_VERSION}  ({VERSITYGW_MODULE}, the tests' S3 server)")
    plan = make_plan()
    paths = plan.paths()
    print(f"\nbinaries for Kubernetes {plan.version} ({plan.bin_dir}):")
    for name in BINARY_NAMES:
        path = paths[name]
        shown = reported_version(path, name) if is_executable(path) else "(not built)"
        print(f"  {name:<24} {shown}")
    s3 = s3_server_path()
    shown = reported_version(s3, S3_SERVER_NAME) if s3_server_ready() else "(not built)"
    print(f"\nthe S3 server ({s3.parent}):\n  {S3_SERVER_NAME:<24} {shown}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetune_dev.binaries",
        description="Build and locate the local control-plane binaries (cached per version).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build whatever is missing, then print the bin dir")
    sub.add_parser("path", help="print the bin dir (builds nothing)")
    sub.add_parser("versions", help="print the pinned versions and what the binaries report")
    sub.add_parser(
        "s3-server", help="build the tests' S3 server (versitygw) if missing, print its path"
    )
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            bins = ensure_binaries(lambda msg: print(msg, file=sys.stderr, flush=True))
            print(bin_dir_for(bins.version))
            return 0
        if args.command == "path":
            print(make_plan().bin_dir)
            return 0
        if args.command == "s3-server":
            print(ensure_s3_server(lambda msg: print(msg, file=sys.stderr, flush=True)))
            return 0
        return _cmd_versions()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

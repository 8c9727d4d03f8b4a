"""The control-plane binaries and the S3 server, with word on stderr before a long build starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kubetune_dev.binaries import (
    Binaries,
    ensure_binaries,
    ensure_s3_server,
    is_complete,
    make_plan,
    s3_server_dir,
    s3_server_ready,
)

BUILD_NOTICE = """\
The integration and e2e tiers need a local control plane that is not built yet: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm are built
from Go modules now (or by the process already building them) into
  {bin_dir}
(docs/control-plane-build.md). A first build takes about 10 minutes on an idle 2-core
machine, up to 20 on a busy one; later runs reuse it. A bare `pytest` (the unit and trainer
tiers, the tooling tests not marked `controlplane`) needs none of it."""

S3_BUILD_NOTICE = """\
The S3 tests need versitygw, an S3 server, which is not built yet: it is built from Go
modules now (or by the process already building it) into
  {bin_dir}
(docs/data.md, "Testing with a local S3 store"). A first build takes about 2 minutes on a
2-core machine; later runs reuse it."""


def control_plane_binaries(say: Callable[[str], None]) -> Binaries:
    """`ensure_binaries`, saying first through `say` when it is going to build."""
    plan = make_plan()
    if not is_complete(plan.bin_dir, plan.expected()):
        say(BUILD_NOTICE.format(bin_dir=plan.bin_dir))
    return ensure_binaries(say)


def s3_server_binary(say: Callable[[str], None]) -> Path:
    """`ensure_s3_server`, saying first through `say` when it is going to build. Raises
    `kubetune_dev.binaries.NoGoError` when it would have to build and there is no Go."""
    if not s3_server_ready():
        say(S3_BUILD_NOTICE.format(bin_dir=s3_server_dir()))
    return ensure_s3_server(say)

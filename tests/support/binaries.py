"""The control-plane binaries, with word on stderr before a long build starts."""

from __future__ import annotations

from collections.abc import Callable

from kubetune_dev.binaries import Binaries, ensure_binaries, is_complete, make_plan

BUILD_NOTICE = """\
The integration and e2e tiers need a local control plane that is not built yet: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and helm are built
from Go modules now (or by the process already building them) into
  {bin_dir}
(docs/control-plane-build.md). A first build takes about 10 minutes on an idle 2-core
machine, up to 20 on a busy one; later runs reuse it. The unit and trainer tiers (a bare
`pytest`) need none of it."""


def control_plane_binaries(say: Callable[[str], None]) -> Binaries:
    """`ensure_binaries`, saying first through `say` when it is going to build."""
    plan = make_plan()
    if not is_complete(plan.bin_dir, plan.expected()):
        say(BUILD_NOTICE.format(bin_dir=plan.bin_dir))
    return ensure_binaries(say)

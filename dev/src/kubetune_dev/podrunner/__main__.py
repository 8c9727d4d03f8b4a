"""`python -m kubetune_dev.podrunner`: the command line of the runner, and its exec helper.

Two uses: the runner itself (`--kubeconfig K --node NAME --work DIR ...`, see the package
docstring), and, internally, `--exec-container FILE`, the helper process the runner starts for
each container, which becomes that container's process (sandbox.exec_container).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubetune_dev.podrunner.api import Api
from kubetune_dev.podrunner.logserver import LogServer
from kubetune_dev.podrunner.node import default_capacity, parse_labels, parse_taints
from kubetune_dev.podrunner.podspec import CLUSTER_DOMAIN, DEFAULT_HOST_IP
from kubetune_dev.podrunner.runner import (
    DEFAULT_POD_IP_BASE,
    HEARTBEAT_SECONDS,
    POLL_SECONDS,
    PodRunner,
    RunnerConfig,
)
from kubetune_dev.podrunner.sandbox import (
    PATH_MAP_ENV,
    ExecSpec,
    exec_container,
    probe_mount_namespace,
)

log = logging.getLogger("kubetune.podrunner")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kubetune_dev.podrunner",
        description="Run the pods bound to one node as local processes (test/demo only).",
    )
    p.add_argument("--kubeconfig", required=True, help="credentials allowed to manage nodes/pods")
    p.add_argument("--node", required=True, help="name of the node this runner plays")
    p.add_argument("--work", required=True, type=Path, help="per-pod folders and logs")
    p.add_argument(
        "--volumes-root",
        type=Path,
        help="backing folders of bound PVs that have no hostPath/local path (default WORK/pv)",
    )
    p.add_argument("--pod-ip-base", default=DEFAULT_POD_IP_BASE, help="pod IPs are BASE2..BASE254")
    p.add_argument("--host-ip", default=DEFAULT_HOST_IP)
    p.add_argument("--labels", default="", help="extra node labels, k=v,k2=v2")
    p.add_argument("--taints", default="", help="node taints, key[=value]:Effect,...")
    p.add_argument("--gpus", type=int, default=0, help="simulated nvidia.com/gpu capacity")
    p.add_argument("--cpu", help="cpu capacity (default: this machine's CPU count)")
    p.add_argument("--memory", help="memory capacity, e.g. 16Gi (default: this machine's)")
    p.add_argument("--pods", type=int, default=110)
    p.add_argument(
        "--pass-env",
        default="LANG,LC_ALL,TZ",
        help="variables passed from the runner's environment to every container",
    )
    p.add_argument("--no-mount-namespace", action="store_true", help="always use the path map")
    p.add_argument("--poll-seconds", type=float, default=POLL_SECONDS)
    p.add_argument("--heartbeat-seconds", type=float, default=HEARTBEAT_SECONDS)
    p.add_argument("--cluster-domain", default=CLUSTER_DOMAIN)
    p.add_argument(
        "--log-port",
        type=int,
        default=0,
        help="port of the container-log endpoint on --host-ip (0: a free one); -1: none",
    )
    p.add_argument("--tls-cert", type=Path, help="serving certificate of the log endpoint")
    p.add_argument("--tls-key", type=Path, help="its key (without both: plain HTTP)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--exec-container"]:  # internal: become a container's process
        exec_container(ExecSpec.from_json(Path(args_list[1]).read_text()))
    args = _parser().parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s podrunner %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    namespace_ok = not args.no_mount_namespace
    if namespace_ok:
        why = probe_mount_namespace()
        if why is not None:
            namespace_ok = False
            log.warning(
                "no private mount namespace (%s): containers see the host's filesystem and find "
                "their volumes through $%s",
                why,
                PATH_MAP_ENV,
            )
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    volumes_root = (args.volumes_root or work / "pv").resolve()
    logs = None
    if args.log_port >= 0:
        logs = LogServer(work, args.host_ip, args.log_port, args.tls_cert, args.tls_key)
        logs.start()
        log.info("container logs served on %s:%d", args.host_ip, logs.port)
    config = RunnerConfig(
        node=args.node,
        work=work,
        volumes_root=volumes_root,
        capacity=default_capacity(args.cpu, args.memory, args.gpus, args.pods),
        labels=parse_labels(args.labels),
        taints=parse_taints(args.taints),
        pod_ip_base=args.pod_ip_base,
        host_ip=args.host_ip,
        mount_namespace=namespace_ok,
        pass_env=tuple(filter(None, args.pass_env.split(","))),
        poll_seconds=args.poll_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        cluster_domain=args.cluster_domain,
        kubelet_port=logs.port if logs is not None else 0,
    )
    stop = False

    def _stop(signum: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    api = Api(args.kubeconfig)
    try:
        PodRunner(api, config).run(lambda: stop)
    finally:
        api.close()
        if logs is not None:
            logs.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

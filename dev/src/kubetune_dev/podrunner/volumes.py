"""A pod's volumes on this machine, and where each container sees them.

`plan_volumes` decides, for every volume of the pod, which host folder stands for it and what
goes in it (files of a ConfigMap, Secret, downward API or projected volume; a folder for an
emptyDir; the bound PV's path for a claim; hostPath checks); `materialise` makes it so on disk.
`plan_mounts` turns a container's volumeMounts into bind mounts (plus /etc/hosts and the
termination-message file), and `path_map`/`map_path` are the fallback when there is no mount
namespace. Planning asks the API server only through `Lookup`; `materialise` alone writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kubetune_dev.podrunner.podspec import (
    Lookup,
    NotReady,
    PodFacts,
    expand,
    field_value,
    resource_value,
)

DEFAULT_TERMINATION_PATH = "/dev/termination-log"
DEFAULT_MODE = 0o644


@dataclass(frozen=True)
class VolumePlan:
    """Where a pod volume lives on this machine and what must be done to make it."""

    name: str
    kind: str
    path: str
    files: dict[str, tuple[bytes, int]] | None = None
    """Written afresh under `path` (configMap, secret, downwardAPI, projected)."""
    create: str | None = None
    """"dir" or "file": create `path` when missing."""
    check: str | None = None
    """"dir", "file" or "exists": `path` must already be there."""
    read_only: bool = False
    owned: bool = False
    """Lives in the pod's folder and goes away with the pod."""


def _safe_relative(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise NotReady("FailedMount", f"invalid path {path!r} in a volume")
    return str(p)


def _project(
    data: Mapping[str, bytes],
    items: Sequence[Mapping[str, Any]] | None,
    default_mode: int,
    what: str,
    optional: bool,
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {_safe_relative(k): (v, default_mode) for k, v in data.items()}
    out: dict[str, tuple[bytes, int]] = {}
    for item in items:
        key = str(item["key"])
        if key not in data:
            if optional:
                continue
            raise NotReady("FailedMount", f"{what} has no key {key!r}")
        out[_safe_relative(str(item["path"]))] = (data[key], int(item.get("mode", default_mode)))
    return out


def _container(pod: Mapping[str, Any], name: str | None) -> Mapping[str, Any]:
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    for c in containers:
        if not name or c.get("name") == name:
            return dict(c)
    return {}


def _downward_files(
    pod: Mapping[str, Any],
    items: Sequence[Mapping[str, Any]],
    default_mode: int,
    facts: PodFacts,
) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for item in items:
        if "fieldRef" in item:
            value = field_value(pod, str(item["fieldRef"]["fieldPath"]), facts)
        elif "resourceFieldRef" in item:
            ref = item["resourceFieldRef"]
            container = _container(pod, ref.get("containerName"))
            value = resource_value(container, ref, facts.allocatable)
        else:
            continue
        mode = int(item.get("mode", default_mode))
        out[_safe_relative(str(item["path"]))] = (value.encode(), mode)
    return out


def _hostpath_plan(name: str, source: Mapping[str, Any]) -> VolumePlan:
    path = str(source["path"])
    kind = str(source.get("type") or "")
    create = {"DirectoryOrCreate": "dir", "FileOrCreate": "file", "": "dir"}.get(kind)
    check = {"Directory": "dir", "File": "file"}.get(kind)
    if kind in ("Socket", "CharDevice", "BlockDevice"):
        check = "exists"
    return VolumePlan(name, "hostPath", path, create=create, check=check)


def plan_volumes(
    pod: Mapping[str, Any],
    pod_dir: Path,
    lookup: Lookup,
    facts: PodFacts,
) -> dict[str, VolumePlan]:
    """One plan per pod volume; raises NotReady for what is missing or unsupported."""
    meta = pod.get("metadata") or {}
    namespace = str(meta.get("namespace", "default"))
    plans: dict[str, VolumePlan] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = str(volume["name"])
        own = str(pod_dir / "volumes" / name)
        if "emptyDir" in volume:
            # medium: Memory is a plain folder too (the host's disk, not a tmpfs).
            plans[name] = VolumePlan(name, "emptyDir", own, create="dir", owned=True)
        elif "hostPath" in volume:
            plans[name] = _hostpath_plan(name, volume["hostPath"])
        elif "persistentVolumeClaim" in volume:
            source = volume["persistentVolumeClaim"]
            path = lookup.claim_path(namespace, str(source["claimName"]))
            plans[name] = VolumePlan(
                name,
                "persistentVolumeClaim",
                path,
                create="dir",
                read_only=bool(source.get("readOnly")),
            )
        elif "configMap" in volume or "secret" in volume:
            is_cm = "configMap" in volume
            source = volume["configMap" if is_cm else "secret"]
            ref = str(source.get("name") if is_cm else source.get("secretName"))
            data = lookup.config_map(namespace, ref) if is_cm else lookup.secret(namespace, ref)
            what = f'{"configmap" if is_cm else "secret"} "{ref}"'
            optional = bool(source.get("optional"))
            if data is None and not optional:
                raise NotReady("FailedMount", f"{what} not found")
            files = _project(
                data or {},
                source.get("items"),
                int(source.get("defaultMode", DEFAULT_MODE)),
                what,
                optional,
            )
            kind = "configMap" if is_cm else "secret"
            plans[name] = VolumePlan(name, kind, own, files=files, read_only=True, owned=True)
        elif "downwardAPI" in volume:
            source = volume["downwardAPI"]
            files = _downward_files(
                pod, source.get("items") or [], int(source.get("defaultMode", DEFAULT_MODE)), facts
            )
            plans[name] = VolumePlan(
                name, "downwardAPI", own, files=files, read_only=True, owned=True
            )
        elif "projected" in volume:
            source = volume["projected"]
            mode = int(source.get("defaultMode", DEFAULT_MODE))
            files = {}
            for part in source.get("sources") or []:
                if "configMap" in part or "secret" in part:
                    is_cm = "configMap" in part
                    ref_src = part["configMap" if is_cm else "secret"]
                    ref = str(ref_src.get("name"))
                    data = (
                        lookup.config_map(namespace, ref)
                        if is_cm
                        else lookup.secret(namespace, ref)
                    )
                    what = f'{"configmap" if is_cm else "secret"} "{ref}"'
                    optional = bool(ref_src.get("optional"))
                    if data is None and not optional:
                        raise NotReady("FailedMount", f"{what} not found")
                    files.update(_project(data or {}, ref_src.get("items"), mode, what, optional))
                elif "downwardAPI" in part:
                    items = part["downwardAPI"].get("items") or []
                    files.update(_downward_files(pod, items, mode, facts))
                elif "serviceAccountToken" in part:
                    tok = part["serviceAccountToken"]
                    token = lookup.token(
                        pod, tok.get("audience"), int(tok.get("expirationSeconds") or 3600)
                    )
                    files[_safe_relative(str(tok["path"]))] = (token.encode(), mode)
                else:
                    kinds = ", ".join(sorted(part))
                    raise NotReady(
                        "FailedMount", f"volume {name}: projected source {kinds} is not supported"
                    )
            plans[name] = VolumePlan(
                name, "projected", own, files=files, read_only=True, owned=True
            )
        else:
            kinds = ", ".join(sorted(k for k in volume if k != "name"))
            raise NotReady(
                "FailedMount",
                f"volume {name}: {kinds} volumes are not supported by the local pod runner",
            )
    return plans


def materialise(volume: VolumePlan) -> None:
    """Make a planned volume exist on disk."""
    path = Path(volume.path)
    if volume.files is not None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        for rel, (data, mode) in volume.files.items():
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode & 0o777)
        return
    if volume.check == "dir" and not path.is_dir():
        raise NotReady("FailedMount", f"hostPath {path} is not a directory")
    if volume.check == "file" and not path.is_file():
        raise NotReady("FailedMount", f"hostPath {path} is not a file")
    if volume.check == "exists" and not path.exists():
        raise NotReady("FailedMount", f"hostPath {path} does not exist")
    if volume.create == "dir" and not path.exists():
        path.mkdir(parents=True)
        if volume.owned:
            path.chmod(0o777)
    elif volume.create == "file" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


def path_depth(path: str) -> int:
    return len(PurePosixPath(path).parts)


def plan_mounts(
    container: Mapping[str, Any],
    volumes: Mapping[str, VolumePlan],
    env: Mapping[str, str],
    *,
    hosts_file: str | None,
    termination_file: str,
    keep_visible: Sequence[str] = (),
) -> list[Mount]:
    """The bind mounts of one container, parents before children.

    `keep_visible` are host folders the command needs from the runner's own environment (the
    virtualenv, the interpreter, our packages). A volume mounted over one of their ancestors
    (an emptyDir at /tmp over a virtualenv under /tmp) would hide them, so they are bound
    back, read-only, at the same path.
    """
    mounts: list[Mount] = []
    for vm in container.get("volumeMounts") or []:
        name = str(vm["name"])
        if name not in volumes:
            raise NotReady("CreateContainerConfigError", f"volumeMount {name!r} has no volume")
        volume = volumes[name]
        source = volume.path
        sub = vm.get("subPath") or expand(str(vm.get("subPathExpr") or ""), env)
        if sub:
            source = str(Path(source) / _safe_relative(str(sub)))
        read_only = bool(vm.get("readOnly")) or volume.read_only
        mounts.append(Mount(source, str(vm["mountPath"]), read_only))
    targets = {m.target for m in mounts}
    if hosts_file is not None and "/etc/hosts" not in targets:
        mounts.append(Mount(hosts_file, "/etc/hosts"))
    term = str(container.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH)
    if term not in targets:
        mounts.append(Mount(termination_file, term))
    volume_targets = [PurePosixPath(m.target) for m in mounts]
    for path in keep_visible:
        p = PurePosixPath(path)
        if path not in targets and any(p != t and p.is_relative_to(t) for t in volume_targets):
            mounts.append(Mount(path, path, True))
    return sorted(mounts, key=lambda m: path_depth(m.target))


def llama_cpp_converter() -> str | None:
    """llama.cpp's GGUF converter, which the trainer image has in /opt/llama.cpp: here the one
    `python -m kubetune_dev.llamacpp build` cached, if it did (None otherwise)."""
    from kubetune_dev.llamacpp import cached

    with contextlib.suppress(OSError, ValueError):
        found = cached()
        if found is not None and (found.converter_dir / "convert_hf_to_gguf.py").is_file():
            return str(found.converter_dir)
    return None


def image_env() -> dict[str, str]:
    """Variables the trainer image sets that a pod run here needs too: where llama.cpp's
    converter is (`KUBETUNE_LLAMA_CPP_DIR`, for the GGUF export step), when it is cached."""
    converter = llama_cpp_converter()
    return {"KUBETUNE_LLAMA_CPP_DIR": converter} if converter else {}


def runtime_paths() -> list[str]:
    """Host folders a pod's command needs from the runner's Python environment (and the
    cached llama.cpp converter)."""
    import kubetune
    import kubetune_dev
    import kubetune_trainer

    converter = llama_cpp_converter()
    paths = {
        sys.prefix,
        sys.base_prefix,
        *([converter] if converter else []),
        *(
            str(Path(pkg.__file__ or "").resolve().parents[1])
            for pkg in (kubetune, kubetune_dev, kubetune_trainer)
        ),
    }
    return sorted(p for p in paths if os.path.isdir(p))


def path_map(mounts: Sequence[Mount]) -> dict[str, str]:
    """mountPath → host path, for the fallback without a mount namespace."""
    return {m.target: m.source for m in mounts}


def map_path(path: str, mapping: Mapping[str, str]) -> str:
    """A container path translated through the path map (longest matching mountPath wins)."""
    best = ""
    for target in mapping:
        if (path == target or path.startswith(target.rstrip("/") + "/")) and len(target) > len(
            best
        ):
            best = target
    if not best:
        return path
    return mapping[best] + path[len(best) :]

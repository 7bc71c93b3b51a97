"""Turn a pod's volumes into host directories and its volumeMounts into bind mounts.

Each pod gets fresh directories for its emptyDirs (``medium: Memory`` ones live
under ``/dev/shm``, a tmpfs, so they are memory-backed as in a cluster without
needing a mount of their own); a ``persistentVolumeClaim`` is a directory per
claim name shared by every pod the same node runs, which is what a
ReadWriteMany claim is to the pods of one job. Projected, downward-API,
Secret and ConfigMap volumes are written as files from the local object maps;
a Secret volume the way the kubelet writes it (each version in a directory of
its own, ``..data`` linked to the current one, each key a link through it), so
``update_secret`` can rotate it as the kubelet does: one atomic swap of the link.
A projected service-account token and the cluster's ``kube-root-ca.crt`` come
from the API server where one runs the pod (``local/kubelet``: the token through
the object store's issuer, the ConfigMap as any other); with none they are left
out, so in-cluster clients in the pod see no credentials, as with
``automountServiceAccountToken: false``. Each container sees the pod's own
``/etc/hosts`` (its name on its IP), as the kubelet writes it, but one run from an
unpacked image, which keeps the image's.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.podrunner.spec import ObjectStore, PodContext, SpecError, field_value

SHM_ROOT = Path("/dev/shm")
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"  # in every namespace of a cluster, with its CA
HOSTS = "/etc/hosts"


@dataclass(frozen=True)
class BindMount:
    """One bind mount inside a container's mount namespace."""

    source: Path
    target: str
    read_only: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"source": str(self.source), "target": self.target, "readOnly": self.read_only}


def _write_items(
    directory: Path, data: Mapping[str, str], items: list[dict[str, Any]] | None
) -> None:
    """Keys of a Secret/ConfigMap as files (all keys, or only ``items`` at their paths)."""
    if items:
        chosen = [(i["key"], i.get("path", i["key"])) for i in items]
    else:
        chosen = [(key, key) for key in data]
    for key, rel in chosen:
        if key not in data:
            raise SpecError(f"key {key!r} is missing for a volume item")
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data[key])


_versions = itertools.count()
DATA_LINK = "..data"


def write_secret_volume(
    directory: Path, data: Mapping[str, str], items: list[dict[str, Any]] | None
) -> None:
    """The kubelet's AtomicWriter: write the new version beside the old, swap ``..data``
    to it with one rename, link any new key through it, then drop the old version.
    Tests that rotate a Secret under a running sidecar write its files with it too."""
    version = f"..version_{os.getpid()}_{next(_versions)}"
    _write_items(directory / version, data, items)
    link = directory / DATA_LINK
    old = os.readlink(link) if link.is_symlink() else None
    staged = directory / "..data_tmp"
    staged.unlink(missing_ok=True)
    staged.symlink_to(version)
    staged.replace(link)
    for entry in (directory / version).iterdir():
        visible = directory / entry.name
        if not visible.is_symlink():
            visible.symlink_to(f"{DATA_LINK}/{entry.name}")
    if old is not None:
        shutil.rmtree(directory / old, ignore_errors=True)


def _object(store: Mapping[str, Mapping[str, str]], name: str, optional: bool) -> Mapping[str, str]:
    if name in store:
        return store[name]
    if optional:
        return {}
    raise SpecError(f"object {name!r} for a volume is not on this machine")


def _projected(
    directory: Path, volume: Mapping[str, Any], pod: PodContext, objects: ObjectStore
) -> None:
    for source in volume.get("sources") or []:
        if "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                target = directory / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(field_value(item["fieldRef"]["fieldPath"], pod))
        elif "configMap" in source:
            ref = source["configMap"]
            if ref["name"] == ROOT_CA_CONFIG_MAP and ref["name"] not in objects.config_maps:
                continue  # published by the API server, which is absent here
            data = _object(objects.config_maps, ref["name"], ref.get("optional", False))
            _write_items(directory, data, ref.get("items") if data else None)
        elif "secret" in source:
            ref = source["secret"]
            data = _object(objects.secrets, ref["name"], ref.get("optional", False))
            _write_items(directory, data, ref.get("items") if data else None)
        elif "serviceAccountToken" in source and objects.service_account_token is not None:
            token = source["serviceAccountToken"]
            target = directory / token["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(objects.service_account_token(token))


@dataclass
class PodVolumes:
    """The host side of every volume of one pod."""

    pod_dir: Path
    claims_dir: Path
    shm_dir: Path
    paths: dict[str, Path]
    # The pod's /etc/hosts, as the kubelet manages it (None: the machine's, unchanged).
    hosts: Path | None = None
    # Secret volumes: volume name -> (Secret name, items), for update_secret.
    secrets: dict[str, tuple[str, list[dict[str, Any]] | None]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        pod: PodContext,
        pod_dir: Path,
        claims_dir: Path,
        objects: ObjectStore,
        uid: str,
    ) -> PodVolumes:
        volumes = cls(pod_dir, claims_dir, SHM_ROOT / f"podrunner-{uid}", {})
        for volume in pod.spec.get("volumes") or []:
            volumes.paths[volume["name"]] = volumes._materialize(volume, pod, objects)
        volumes.hosts = write_hosts_file(pod_dir / "etc-hosts", pod)
        return volumes

    def _materialize(
        self, volume: Mapping[str, Any], pod: PodContext, objects: ObjectStore
    ) -> Path:
        name = str(volume["name"])
        local = self.pod_dir / "volumes" / name
        if "emptyDir" in volume:
            memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            path = self.shm_dir / name if memory else local
            # World-writable, as the kubelet makes an emptyDir: containers of one
            # pod run as different users (the sidecar as its image's).
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
        elif "persistentVolumeClaim" in volume:
            path = self.claims_dir / str(volume["persistentVolumeClaim"]["claimName"])
        elif "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
        elif "projected" in volume:
            path = local
            path.mkdir(parents=True, exist_ok=True)
            _projected(path, volume["projected"], pod, objects)
        elif "secret" in volume:
            ref = volume["secret"]
            path = local
            path.mkdir(parents=True, exist_ok=True)
            data = _object(objects.secrets, str(ref.get("secretName")), ref.get("optional", False))
            write_secret_volume(path, data, ref.get("items"))
            self.secrets[name] = (str(ref.get("secretName")), ref.get("items"))
        elif "configMap" in volume:
            ref = volume["configMap"]
            path = local
            path.mkdir(parents=True, exist_ok=True)
            data = _object(objects.config_maps, str(ref.get("name")), ref.get("optional", False))
            _write_items(path, data, ref.get("items"))
        elif "downwardAPI" in volume:
            path = local
            _projected(path, {"sources": [volume]}, pod, objects)
        else:
            kinds = sorted(set(volume) - {"name"})
            raise SpecError(f"volume {name!r}: unsupported kind {kinds}")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def update_secret(self, secret: str, data: Mapping[str, str]) -> int:
        """Rotate every volume of Secret ``secret`` to ``data``; how many there were."""
        rotated = 0
        for volume, (name, items) in self.secrets.items():
            if name == secret:
                write_secret_volume(self.paths[volume], data, items)
                rotated += 1
        return rotated

    def mounts_for(
        self, container: Mapping[str, Any], termination_log: Path, host_mount_points: bool = True
    ) -> list[BindMount]:
        """The container's volumeMounts plus its termination message file, as bind mounts.

        ``host_mount_points``: the container sees this machine's root, so missing
        mount points are made there (a container from an image root makes its own)."""
        mounts: list[BindMount] = []
        for mount in container.get("volumeMounts") or []:
            name = str(mount["name"])
            if name not in self.paths:
                raise SpecError(f"volumeMount {name!r} names no volume of the pod")
            source = self.paths[name]
            if mount.get("subPath"):
                source = source / str(mount["subPath"])
                source.mkdir(parents=True, exist_ok=True)
            mounts.append(BindMount(source, str(mount["mountPath"]), bool(mount.get("readOnly"))))
        path = str(container.get("terminationMessagePath") or "/dev/termination-log")
        # As the kubelet makes it: any user the container runs as may write it.
        termination_log.touch()
        termination_log.chmod(0o666)
        mounts.append(BindMount(termination_log, path))
        # A container of an unpacked image keeps the image's own (its root stays unwritten:
        # a mount point would be a file made in it); the others, this machine's root, the pod's.
        if (
            host_mount_points
            and self.hosts is not None
            and not any(m.target == HOSTS for m in mounts)
        ):
            mounts.append(BindMount(self.hosts, HOSTS))
        if host_mount_points:
            for bind in mounts:
                _ensure_mount_point(bind)
        return mounts

    def remove(self) -> None:
        """Drop the pod's emptyDirs (claims and host paths stay, as in a cluster)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)


def write_hosts_file(path: Path, pod: PodContext) -> Path | None:
    """The kubelet's ``/etc/hosts`` for a pod: localhost, the pod's own name on its IP
    (a PyTorchJob's ``MASTER_ADDR`` is the master pod's name, which the master must
    resolve to itself), and its ``hostAliases``. None for a ``hostNetwork`` pod, which
    sees the machine's.

    A pod of a subdomain also gets the shorter names of its FQDN that cluster DNS
    resolves through the pod's search domains (``hostname.subdomain``: a TrainJob's
    ``PET_MASTER_ADDR``), since no DNS server runs here."""
    if pod.spec.get("hostNetwork"):
        return None
    metadata = pod.metadata
    hostname = str(pod.spec.get("hostname") or metadata.get("name", ""))
    names = [hostname]
    if pod.spec.get("subdomain"):
        namespace = metadata.get("namespace", "default")
        fqdn = f"{hostname}.{pod.spec['subdomain']}.{namespace}.svc.cluster.local"
        names = [fqdn, hostname, *_search_names(fqdn)]
    lines = [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod.pod_ip}\t{' '.join(names)}",
    ]
    for alias in pod.spec.get("hostAliases") or []:
        lines.append(f"{alias['ip']}\t{' '.join(alias.get('hostnames') or [])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)
    return path


def _search_names(fqdn: str) -> list[str]:
    """``a.b.ns.svc.cluster.local`` -> ``a.b``, ``a.b.ns``, ``a.b.ns.svc``: what a search
    domain of the pod's namespace, ``svc.cluster.local`` or ``cluster.local`` completes."""
    parts = fqdn.split(".")
    return [".".join(parts[:n]) for n in range(2, len(parts) - 1)]


def _ensure_mount_point(bind: BindMount) -> None:
    """A bind mount needs a target of the same kind; create an empty one if it is missing."""
    target = Path(bind.target)
    if target.exists():
        return
    if bind.source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()

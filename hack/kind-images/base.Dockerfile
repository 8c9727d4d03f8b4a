# kind's node base image (images/base/Dockerfile of kind v0.31.0 to v0.33.0) rebuilt on a local Debian
# image, for the legacy builder (no COPY --chmod, no multi-platform stages): the files and
# packages are kind's; containerd, ctr, containerd-shim-runc-v2, crictl and the CNI plugins are built
# from their Go modules by hack/kind-node-image.sh and copied in from the build context; runc
# is Debian's. Build context layout: files/ (kind's images/base/files), bin/, cni/.
ARG BASE_IMAGE=kubetune/debian:bookworm
FROM ${BASE_IMAGE}

COPY files/usr/local/bin/ /usr/local/bin/
COPY files/kind/ /kind/
COPY files/LICENSES/ /LICENSES/
COPY files/etc/ /etc/

RUN chmod 0755 /kind/bin /kind/bin/* /usr/local/bin/* \
    && echo "Installing Packages ..." \
    && DEBIAN_FRONTEND=noninteractive clean-install \
      systemd \
      conntrack iptables nftables iproute2 ethtool util-linux mount kmod \
      libseccomp2 pigz fuse-overlayfs \
      nfs-common open-iscsi \
      bash ca-certificates curl jq procps \
      runc \
    && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
    && rm -f /lib/systemd/system/multi-user.target.wants/* \
    && rm -f /etc/systemd/system/*.wants/* \
    && rm -f /lib/systemd/system/local-fs.target.wants/* \
    && rm -f /lib/systemd/system/sockets.target.wants/*udev* \
    && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \
    && rm -f /lib/systemd/system/basic.target.wants/* \
    && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
    && ln -s "$(which systemd)" /sbin/init

RUN echo "Enabling / Disabling services ... " \
    && systemctl enable kubelet.service \
    && systemctl enable containerd.service \
    && systemctl enable undo-mount-hacks.service \
    && systemctl mask systemd-binfmt.service

RUN echo "Ensuring /etc/kubernetes/manifests" \
    && mkdir -p /etc/kubernetes/manifests

COPY bin/containerd bin/ctr bin/containerd-shim-runc-v2 bin/crictl /usr/local/bin/
RUN ctr oci spec \
        | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
        | jq 'del(.process.rlimits)' \
        > /etc/containerd/cri-base.json \
    && containerd --version \
    && runc --version \
    && crictl --version

COPY cni/ /opt/cni/bin/

ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]

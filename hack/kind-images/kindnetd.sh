#!/bin/bash
# A minimal stand-in for kind's kindnetd (whose source the Go module proxy does not serve):
# the same job for a single-family IPv4 cluster on one Docker network.
#   - writes /etc/cni/net.d/10-kindnet.conflist (ptp + host-local with this node's podCIDR,
#     portmap), the CNI config kindnetd writes;
#   - routes every other node's podCIDR via that node's InternalIP;
#   - masquerades traffic from POD_SUBNET leaving POD_SUBNET.
# Runs in kind's kindnet DaemonSet unchanged (hostNetwork, env HOST_IP and POD_SUBNET, the
# kindnet service account); talks to the API server with curl and the service account token.
set -u -o pipefail
SA=/var/run/secrets/kubernetes.io/serviceaccount
API="https://${KUBERNETES_SERVICE_HOST}:${KUBERNETES_SERVICE_PORT}"
CNI_DIR=${CNI_CONFIG_DIR:-/etc/cni/net.d}
CONF="$CNI_DIR/10-kindnet.conflist"
INTERVAL=${KINDNET_RESYNC_SECONDS:-10}
: "${HOST_IP:?HOST_IP not set}" "${POD_SUBNET:?POD_SUBNET not set}"

log() { echo "$(date -u +%FT%TZ) kindnetd: $*"; }

mtu() {
  local dev
  dev=$(ip -o route get "$HOST_IP" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
  if [ -z "$dev" ] || [ "$dev" = lo ]; then
    dev=$(ip -o -4 addr show | awk -v ip="$HOST_IP" '{split($4, a, "/"); if (a[1] == ip) print $2}' | head -n1)
  fi
  cat "/sys/class/net/${dev:-eth0}/mtu" 2>/dev/null || echo 1500
}

write_conf() {
  local cidr=$1 tmp
  tmp="$CNI_DIR/.10-kindnet.conflist.tmp"
  cat >"$tmp" <<JSON
{
  "cniVersion": "0.3.1",
  "name": "kindnet",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{ "dst": "0.0.0.0/0" }],
        "ranges": [[{ "subnet": "$cidr" }]]
      },
      "mtu": $(mtu)
    },
    {
      "type": "portmap",
      "capabilities": { "portMappings": true }
    }
  ]
}
JSON
  if cmp -s "$tmp" "$CONF"; then
    rm -f "$tmp"
  else
    mv -f "$tmp" "$CONF"
    log "wrote $CONF for $cidr"
  fi
}

log "starting: HOST_IP=$HOST_IP POD_SUBNET=$POD_SUBNET API=$API"
while true; do
  if nodes=$(curl -fsS --max-time 10 2>/dev/null --cacert "$SA/ca.crt" -H "Authorization: Bearer $(cat "$SA/token")" \
      "$API/api/v1/nodes" | jq -r '.items[] | [(.spec.podCIDR // ""),
        (first(.status.addresses[]? | select(.type == "InternalIP") | .address) // "")] | @tsv'); then
    while IFS=$'\t' read -r cidr ip; do
      if [ -z "$cidr" ] || [ -z "$ip" ]; then continue; fi
      case "$cidr" in *:*) continue ;; esac
      if [ "$ip" = "$HOST_IP" ]; then
        write_conf "$cidr"
      elif ! ip route show "$cidr" | grep -q "via $ip "; then
        ip route replace "$cidr" via "$ip" && log "route $cidr via $ip"
      fi
    done <<<"$nodes"
  else
    # Until kube-proxy has written the rules for the kubernetes service, its address is not
    # reachable (or answered by whatever the node's default route leads to).
    log "listing nodes at $API failed; retrying in 2s"
    sleep 2
    continue
  fi
  if ! iptables -t nat -C POSTROUTING -s "$POD_SUBNET" ! -d "$POD_SUBNET" -j MASQUERADE 2>/dev/null; then
    iptables -t nat -A POSTROUTING -s "$POD_SUBNET" ! -d "$POD_SUBNET" -j MASQUERADE \
      && log "masquerading $POD_SUBNET"
  fi
  # Until this node's CNI config exists (its podCIDR not assigned yet), look again soon.
  if [ -f "$CONF" ]; then sleep "$INTERVAL"; else sleep 2; fi
done

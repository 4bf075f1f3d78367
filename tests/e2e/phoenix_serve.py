"""Run Arize Phoenix (`phoenix serve`) for the OpenTelemetry export test (tests/it/otel.rs),
listening on loopback only.

Phoenix binds its HTTP server to PHOENIX_HOST but its gRPC OTLP receiver to every interface
("[::]:PHOENIX_GRPC_PORT"). The tests listen on loopback only, so the gRPC server's insecure
ports are rewritten to 127.0.0.1 before Phoenix starts. Everything else is `phoenix serve`
as shipped, configured through its PHOENIX_* variables (tests/it/otel.rs sets them).

With COLLAB_EXIT_ON_STDIN_EOF=1 the server exits when its standard input closes, removing
PHOENIX_WORKING_DIR first: the tests share one Phoenix per test process and hold the write end of
that pipe until they end, however they end.
"""

import os
import shutil
import sys
import threading


def _exit_when_stdin_closes():
    sys.stdin.buffer.read()
    working_dir = os.environ.get("PHOENIX_WORKING_DIR")
    if working_dir:
        shutil.rmtree(working_dir, ignore_errors=True)
    os._exit(0)


if os.environ.get("COLLAB_EXIT_ON_STDIN_EOF") == "1":
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()

import grpc.aio

_make_server = grpc.aio.server


def _loopback_server(*args, **kwargs):
    server = _make_server(*args, **kwargs)
    add_port = server.add_insecure_port

    def add_loopback_port(address):
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"127.0.0.1:{port}"
        return add_port(address)

    server.add_insecure_port = add_loopback_port
    return server


grpc.aio.server = _loopback_server

from phoenix.server.main import main  # noqa: E402  (after the patch above)

if __name__ == "__main__":
    sys.argv = ["phoenix", "serve"]
    sys.exit(main())

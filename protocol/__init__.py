"""The wire protocol shared by the server, the clients and the load tests (docs/protocol.md).

A top-level package, not part of `service`, so that a client imports the frames without the
server, the engine or torch; it depends on msgspec only.
"""

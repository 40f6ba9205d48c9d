"""/v1/chat: the WebSocket chat protocol (docs/protocol.md).

    connection.py  ChatConnection: one socket's state machine, frames in, refusals as errors
    turn.py        Turn: one answer: the prompt, the stream of deltas, the stored turn, `done`
    sender.py      FrameSender: the connection's bounded outgoing queue and its one writer

A connection works with the `ChatParts` the server hands it (limits, gate, admission, engine,
conversation cache, metrics, the tenants' session stores), nothing else.
"""

"""Who may come in.

    gate.py     Gate: API keys and their tenants, the Origin rule, failed-attempt accounting
    guard.py    Guard: the gate in front of the HTTP endpoints
    limiter.py  AttemptLimiter: failures per address or session, doubling waits, bounded

A refusal is a `service.api.refusal.Refusal`; each transport words it.
"""

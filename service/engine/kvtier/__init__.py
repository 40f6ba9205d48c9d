"""The third KV tier: blocks that outlive the process, shared by replicas, addressed by hash.

Device pool -> CPU pool -> this tier. A block reaches it when it leaves the CPU pool (or the
device pool, where no CPU room is left) and, for conversations, when a turn is stored; a
prompt whose prefix misses both pools asks it for the following blocks before recomputing.

Its only client is the engine, through one seam: `connector.py` (KVTierConnector: the
scheduler side, TierScheduler, deciding what to load and save, and the worker side,
TierWorker, moving K/V between the pools and the tier; TierState, a sequence's load).
Underneath: `config.py` (KVTierConfig), `record.py` (a stored block: header, checks, codecs),
`backend.py`, `dir_backend.py` and `redis_backend.py` (where records live), `tier.py` (KVTier:
the writer and reader threads the connector hands work to, and the counters).

NOTE (what the tier may cost): speed only. Writes are queued to a thread (bounded in bytes:
past the bound a write is dropped and counted) and never wait on storage; reads run on
another thread while the sequence waits and others decode; a failing, slow or full backend
makes a write or a read fail, be counted, and the block be recomputed. Nothing the tier
returns is used before every check of `record.decode` passed.
"""

"""KVSync: the gRPC protocol that keeps a remote drafter's per-request KV state in step with the
target engine (placement ``separate``), defined in ``protos/specserve/v1/kvsync.proto``.

- ``client`` — ``RemoteProposer``: the engine side; a ``Proposer`` whose drafts come over KVSync.
- ``server`` — ``DraftServer``: the draft side; holds drafters and their per-caller sequences.
- ``drafters`` — building drafters (draft model, layer skip, n-gram) inside a DraftServer.
- ``limits``, ``tls``, ``budget`` — message caps and bounds, TLS credentials, and how long a
  step waits for drafts before it goes plain (lossless).
"""

"""specserve core: engine, speculative decoding, routing policy, telemetry, gRPC glue, CLI.

The engine core (``cluster.engine``, ``cluster.models``, ``cluster.speculative``) imports no Ray and no
gRPC; ``deployments`` wraps it for Ray Serve.
"""

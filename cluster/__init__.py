"""specserve core: engine, speculative decoding, routing policy, telemetry, gRPC glue, CLI.

The engine core (``cluster.engine``, ``cluster.models``, ``cluster.speculative``) imports no Ray and no
gRPC; ``deployments`` wraps it for Ray Serve. The packages stack in floors, each importing only
those below it: ``common`` < ``kernels``, ``sampling``, ``telemetry``, ``routing`` < ``models`` <
``speculative`` < ``engine`` < ``api`` < ``kvsync`` < ``deployments`` < ``bench`` < ``mapper`` <
``commands`` < ``cli`` (declared and checked in ``tests/test_layers.py``).
"""

"""The bottom floor: what every other package shares and nothing here imports from them.

- ``request``   sampling parameters, requests, outputs, finish reasons, speculation counters,
                model limits.
- ``errors``    errors that cross layers (bad input, overloaded, unavailable, user-facing).
- ``config``    the internal engine and speculation configuration.
- ``segments``  traffic segment labels, bounded to what the service keeps.
- ``cache_dir`` where converted models, derived drafts and compiled kernels are cached.

The layer order of the packages above is declared and checked in ``tests/test_layers.py``.
"""

"""Ray Serve deployments wrapping the ``cluster`` core: Router (gRPC ingress), SpecEngine,
BatchEngine, DraftServer, and the app builder ``deployments.app:build``."""

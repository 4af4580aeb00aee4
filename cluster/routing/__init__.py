"""Router policy: which engine path a request takes. Pure code (no Ray, no gRPC)."""

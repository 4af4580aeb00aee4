"""gRPC glue free of Ray: stub generation, request validation/conversion, auth, responses."""

"""Generated gRPC stubs; regenerate with `make proto`."""

"""Model architectures, one module per family, and the registry."""

"""Model architectures (one file per family), shared layers, registry and weight loading."""

"""Device kernels (imported lazily; nothing here is needed on CPU)."""

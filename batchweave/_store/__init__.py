"""Object-store layer: the interface, its backends and wrappers. Knows nothing of manifests."""

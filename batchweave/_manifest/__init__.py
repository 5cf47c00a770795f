"""Versioned manifests: the models, their encoding, segments and the commit protocol."""

"""Data preparation: robust image decoding, folder ingest to memory-mapped arrays, manifests and the
built-in synthetic leaf dataset. Must not import the engine's autograd."""

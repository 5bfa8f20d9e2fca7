"""Building blocks of the engine's models: norms, rotary embeddings, attention, MLP."""

"""Models the probe can build for you: the embedded default SmolLM2 (`embedded.py`) and random models of real
architectures from their published configs (`synthetic.py`, for `make-checkpoint --synthetic`)."""

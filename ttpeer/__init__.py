"""ttpeer: pool your own machines into one training run."""

__version__ = "0.1.0"

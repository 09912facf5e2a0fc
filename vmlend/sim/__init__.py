"""The simulated SmartIO cluster (the embedded default backend)."""

"""Unit tests, one package per package of vmlend (``core``: the top-level modules)."""

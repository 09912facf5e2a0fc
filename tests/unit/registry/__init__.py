"""Tests of `vmlend.registry`."""

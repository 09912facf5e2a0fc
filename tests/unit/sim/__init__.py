"""Tests of `vmlend.sim`."""

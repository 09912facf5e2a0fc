"""Tests of `vmlend.ops`."""

"""Tests of `vmlend.cli`."""

"""Tests of `vmlend.memory`."""

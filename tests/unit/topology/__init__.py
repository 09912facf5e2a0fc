"""Tests of `vmlend.topology`."""

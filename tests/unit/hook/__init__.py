"""Tests of `vmlend.hook`."""

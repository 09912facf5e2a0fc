"""Tests of `vmlend.domain`."""

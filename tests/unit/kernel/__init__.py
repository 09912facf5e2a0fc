"""Tests of `vmlend.kernel`."""

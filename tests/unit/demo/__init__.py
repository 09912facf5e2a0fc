"""Tests of `vmlend.demo`."""

"""Tests of `vmlend.fabric`."""

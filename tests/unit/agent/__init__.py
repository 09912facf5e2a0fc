"""Tests of `vmlend.agent`."""

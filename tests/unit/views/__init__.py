"""Tests of `vmlend.views`."""

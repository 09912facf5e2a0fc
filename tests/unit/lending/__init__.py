"""Tests of `vmlend.lending`."""

"""Tests of `vmlend.irq`."""

"""Tests of `vmlend.hypervisor`."""

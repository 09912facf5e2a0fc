"""Tests of `vmlend.nvme`."""

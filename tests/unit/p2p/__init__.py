"""Tests of `vmlend.p2p`."""

"""Tests of `vmlend.ledger`."""

"""Tests of the top-level modules of vmlend (hostenv, errors, messages, ...)."""

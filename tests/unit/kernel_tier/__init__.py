"""Tests of the kernel tier's tools (`kernel-tier/`)."""

"""Placeholder until vmlend.domain lands (wired at merge)."""

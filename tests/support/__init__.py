"""Helpers of the test suite: daemons, fake hosts, cluster and domain builders. No test
module imports another; what two of them share lives here."""

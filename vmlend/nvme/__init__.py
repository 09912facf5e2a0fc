"""NVMe rules shared by every plane: the spec's constants and entries, PRP lists, shares and
their geometry, the guard's address spaces, and identify data (docs/design.md mechanism 11;
docs/nvme-sharing.md). The registry's ledger of shared drives and shares is
``vmlend.ledger.nvmeshares``, the hook's side ``vmlend.lending.shares``.
The simulated controller, driver, manager and virtual controller are in ``vmlend.sim.nvme``."""

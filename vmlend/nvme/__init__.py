"""NVMe rules shared by every plane: the spec's constants and entries, PRP lists, shares and
their geometry, the guard's address spaces, identify data, and the registry's ledger of shared
drives and shares with their NTB claims (docs/design.md mechanism 11; docs/nvme-sharing.md).
The simulated controller, driver, manager and virtual controller are in ``vmlend.sim.nvme``."""

"""The simulated NVMe side: a controller model with the guard in it, its namespace in a
sparse file, the host driver (the manager's and a guest's), the manager and the virtual
controller a VM with a share sees. The pure NVMe rules these use live in ``vmlend.nvme``."""

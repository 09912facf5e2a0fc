"""NVMe: a controller model for the simulator, the guard that keeps each queue owner inside its
LBA window, a small host driver, and the manager that shares one drive among VMs at the queue
level (docs/design.md mechanism 11; docs/nvme-sharing.md)."""

"""Interrupt relay: a lent device's interrupts, raised on the lender, reach the VM's eventfds.

Modules: ``eventfd`` (owning an eventfd), ``vectors`` (enabled vectors from config space and
the MSI-X table), ``gate`` (masking without loss), ``vfio`` (SET_IRQS vocabulary, simulated
host kernel), ``transport`` (the lender-borrower channel), ``relay`` (the event loop),
``lender`` / ``borrower`` (the two sides), ``control`` / ``daemon`` / ``client`` (the
``vmlend relay`` daemon and its control socket). See docs/interrupts.md.
"""

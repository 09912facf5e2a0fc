"""The composition root: the one place that imports both the real host's backends
(``vmlend.kernel``, libvirt) and the simulation's (``vmlend.sim``), and picks between them
from a backend name or a hypervisor URI. Everything below it depends on protocols only."""

"""Guest-physical memory: QEMU x86 layouts, the pin probe, and DMA window planning.

See docs/memory.md. ``layout`` (pure rules), ``domain_memory`` (domain XML -> MemoryConfig),
``qmp`` (a real QEMU's flat view), ``probe`` (the pin probe), ``windows`` (DMA window plans).
"""

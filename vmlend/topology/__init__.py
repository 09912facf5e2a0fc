"""The fabric's vocabulary, shared by every plane: the data model (nodes, adapters, devices,
holders), the TOML topology format, NTB routes, PCIe paths stage by stage, and the compiled form
the registry stores. Imports nothing of the backends."""

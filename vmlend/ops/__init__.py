"""The domain operations: attach, detach, migrate and status collection.

The CLI, the demo (and the agent) call these; they take an opened hypervisor and fabric and
report progress through a callback, so the CLI modules only parse options and print. The
libvirt hook's own operations (prepare, release, reconnect) are in ``vmlend.hook.ops``.
"""

"""Who holds what: holds, claims and their admission, fences, mdev records and NVMe shares.

Production code on every host: the kernel backend and the simulated cluster keep the same
ledger in the registry and differ only in the hardware their borrows drive.
"""

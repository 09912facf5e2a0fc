"""``vmlend agent``: the per-host service of a cluster registry. It keeps the host's etcd lease
alive (the host's holds, claims, mdev and runtime records are attached to it) and, as a
lender, takes back devices whose holder's lease ended (fencing). See docs/cluster.md."""

"""Taking remote devices (``devices``) and NVMe shares (``shares``) for a VM and giving them
back: the steps the hook, the CLI's hot-plug and the agent's recovery share."""

"""The fabric: its data model, its interface and its backends (``sim``, ``smartio``)."""

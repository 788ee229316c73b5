"""Domain services: they take a Session, do the work, ``flush()``; the caller commits."""

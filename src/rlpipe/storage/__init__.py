"""Storage: database sessions, the object store, and the buffer/audit queries over them."""

"""Activities: thin adapters from Temporal to the library packages.

Each takes one payload, opens a transaction or a client, calls one library function and returns
a small result. Failures are recorded in `failures` (once per attempt) before Temporal retries.
"""

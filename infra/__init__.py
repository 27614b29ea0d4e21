"""The local stack of real servers and the supervision of background processes."""

"""Observability: Prometheus metrics (`metrics`), the SQL behind every number (`queries`), the run
report with its plots (`report`, `plots`) and the automatic diagnosis (`doctor`).

Importing this package imports nothing heavy; matplotlib loads only with `observe.plots`.
"""

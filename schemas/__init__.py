"""Shapes only: run configuration (pydantic), workflow/activity payloads (dataclasses), tables."""

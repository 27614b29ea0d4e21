"""Environments: tasks the policy acts in (prompt sets, chat framing, tool-call protocol, rubric).

Plain Python with no I/O of its own: tools that need isolation run through an injected `Executor`.
Start with `envs.base` (the protocol) and `envs.toolcalls` (the text syntax).
"""

"""The `rlpipe` command and the tools it runs beside the workers: run commands, the demo, chaos runs."""

# The built-in environments and graders: a config's env.name and grader.name are checked against the
# registries loaded in the process (rlpipe.registry), so a bad name stops in the command line.
import rlpipe.envs.registry  # noqa: F401
import rlpipe.graders.registry  # noqa: F401

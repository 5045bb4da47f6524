"""The one error a config that cannot run raises; its own module so that any layer can raise it."""


class P3DConfigError(ValueError):
    """A config that cannot run. The message is one line: field, value, fix."""

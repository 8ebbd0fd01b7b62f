"""Exceptions that cross module boundaries, with messages a user can act on."""


class PdserveError(Exception):
    """Base class for pdserve's own errors."""


class ModelLoadError(PdserveError):
    """A model folder or file is missing, corrupt, or of an unsupported architecture."""


class ConfigError(PdserveError):
    """A flag or environment variable has a value pdserve cannot use."""


# a node's exit code when no restart can help (refused for its numerics before its load):
# `pdserve up` does not start it again (EX_CONFIG of sysexits.h)
EXIT_REFUSED = 78

"""Exceptions that cross module boundaries, with messages a user can act on."""


class PdserveError(Exception):
    """Base class for pdserve's own errors."""


class ModelLoadError(PdserveError):
    """A model folder or file is missing, corrupt, or of an unsupported architecture."""


class ConfigError(PdserveError):
    """A flag or environment variable has a value pdserve cannot use."""

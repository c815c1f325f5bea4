"""Exceptions a user can act on.

Everything under SomaError is the user's input being wrong (config, flags, files, messages):
CLIs print one `error:` line and exit 2. Anything else is an internal failure (exit 1).
"""


class SomaError(Exception):
    """Base of all user-facing errors."""


class ConfigError(SomaError):
    """A configuration value is impossible; the message names the field."""


class DeviceError(SomaError):
    """An execution provider, device or ONNX Runtime install that cannot be used; the message names the missing
    package, library or node, and what to install (soma_edge.engine.runtime)."""


class CorpusError(SomaError):
    """A corpus, shard or data file that cannot be used."""


class CodecError(SomaError):
    """A msgpack message or file that is malformed, oversized or of the wrong schema."""


class CheckpointError(SomaError):
    """A checkpoint that is missing, corrupt or does not match the run."""


class ValidationError(SomaError):
    """A worker reply that must not be accepted (shape, dtype, NaN, stale version, ...)."""


class LinkError(SomaError):
    """The coordinator cannot be reached, or stopped answering."""

"""What can be wrong with a model folder or file; each message says what to fix."""

from __future__ import annotations


class ModelFolderError(ValueError):
    """A model folder cannot be read; the message says what to fix."""


class MissingModelFileError(ModelFolderError, FileNotFoundError):
    """The folder, its ``config.json`` or its safetensors file(s) are missing."""


class UnsupportedModelError(ModelFolderError):
    """The folder's ``model_type`` (or a variant of it, such as a post-LN OPT) has no translation here."""


class MissingWeightError(ModelFolderError, KeyError):
    """A tensor the model needs is not in the folder's safetensors files."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class WeightShapeError(ModelFolderError):
    """A stored tensor's shape does not match the one ``config.json`` implies."""

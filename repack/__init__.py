"""repack: offline repacking of ML training data into fast sequential formats."""

__version__ = "0.1.0"

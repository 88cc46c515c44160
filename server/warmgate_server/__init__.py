"""warmgate's embedding server: warm every shape before /ready, then serve without cold hits."""

__version__ = "0.1.0"

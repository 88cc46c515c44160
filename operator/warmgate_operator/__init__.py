"""warmgate operator: reconciles EmbeddingServices (warmgate.dev/v1alpha1) with kopf."""

__version__ = "0.1.0"

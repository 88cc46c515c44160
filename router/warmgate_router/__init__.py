"""warmgate-router: one OpenAI and TEI endpoint for every EmbeddingService and alias."""

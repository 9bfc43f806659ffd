"""Looking inside a checkpoint before exporting it: attention heatmaps, head diversity, per-layer statistics,
embedding neighbours, gathered on one static HTML page (`textgen-export inspect`)."""

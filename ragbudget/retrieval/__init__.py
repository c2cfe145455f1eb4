"""Finding passages: embedders, executors, vector and lexical search, the index."""

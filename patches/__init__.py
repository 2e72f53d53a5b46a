"""One module per model family; each patches exactly one seam (the attention) of that family."""

"""draftsmith.kernels."""

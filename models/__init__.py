"""draftsmith.models."""

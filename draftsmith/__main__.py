"""`python -m draftsmith ...` and `accelerate launch -m draftsmith train RECIPE` both land here."""

from draftsmith.cli import entry

if __name__ == "__main__":
    entry()

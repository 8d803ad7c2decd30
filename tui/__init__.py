"""The Textual chat app (a later issue)."""

"""Command lines over the whole package (tools/*.py call these)."""

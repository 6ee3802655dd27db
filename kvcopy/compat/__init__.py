"""Drop-in replacements for other projects' copy ops."""

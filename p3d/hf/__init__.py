"""Hugging Face: the architectures p3d reads and writes (one description each, architectures/), the import (checked
without torch before any worker starts, then read slice by slice), the export, and the tokenizer files."""

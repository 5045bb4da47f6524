"""Hugging Face: import a Llama checkpoint, export one, and the tokenizer files."""

"""Torch-free text processing: tokenizer, incremental detokenizer and chat templates.

Used by the API process and by the offline `hotstart generate` alike."""

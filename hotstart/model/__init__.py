"""The model layer. files.py and cursor.py are torch-free (the API process uses them too); the rest
imports torch."""

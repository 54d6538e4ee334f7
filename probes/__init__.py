"""One probe per mismatch source, qualification, and live collapse monitors (see README.md)."""

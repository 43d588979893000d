"""What every layer may use: array types, the import guard, buffers and resource bases."""

"""Data: rows read and checked, tokenized, masked, packed and batched, from files or a stream."""

"""Data preparation: raw corpus to a cleaned, tokenized, sharded, validated dataset."""

"""Tokenizer-hostile text for data round trips (TRICKY)."""

TRICKY = "Ünïcödé ☃ 日本語 — tabs\tand\r\nCRLF, a literal ▁ and ▁▁, emoji 😀, <|eod|> </s>\n\n\t \n"

"""A small sentencepiece corpus fixture (corpus) shared by the data, SFT and Hugging Face tests."""

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé ☃ 日本語 — tabs\tand\r\nCRLF, emoji 😀 <|endoftext|>\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    x: int = 0\n    y: int = 0\n",
]


def corpus(n: int) -> list[str]:
    """``n`` small code-like documents (deterministic)."""
    return [TEXTS[i % len(TEXTS)] + f"value_{i} = {i * 7 % 13}\n" for i in range(n)]

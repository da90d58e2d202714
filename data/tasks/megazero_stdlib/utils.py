"""Loaders of the shipped tasks' data for lm-evaluation-harness (``custom_dataset`` in the task
YAML files beside this one): the JSON lines next to this file, read with no network and no
``datasets`` cache (``datasets.Dataset.from_list``). ``build.py`` writes them."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _rows(name: str) -> list[dict]:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def multiple_choice(**_):
    """``{"test": Dataset}`` of ``mc.jsonl`` (context, choices, label); the harness passes the
    task's metadata as keyword arguments, unused here."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("mc.jsonl"))})


def perplexity(**_):
    """``{"test": Dataset}`` of ``ppl.jsonl`` (text)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("ppl.jsonl"))})


def doc_to_text(doc) -> str:
    """The context: the lines before the target line, verbatim."""
    return doc["context"]


def doc_to_choice(doc) -> list[str]:
    """The four candidate next lines (each with its line ending)."""
    return list(doc["choices"])

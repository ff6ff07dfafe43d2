"""The prompts an experiment measures on: a built-in set of plain English passages, the requests
of a workload file (.jsonl), or given texts (a session's, read by
sessions.lab_input.experiment_prompts). Token ids from the loaded model's tokenizer, each cut to
`max_tokens`."""

from __future__ import annotations

from pathlib import Path

BUILTIN = (
    "The river rose through the night, and by morning the lower fields were under a sheet of "
    "brown water. The farmers gathered on the bridge to watch the current carry fence posts, "
    "branches and, once, a bewildered goat past the mill. Nobody could remember a flood like it.",
    "To make bread, mix flour, water, salt and a little yeast into a shaggy dough. Let it rest, "
    "then fold it every half hour until it is smooth and elastic. Shape a loaf, let it rise "
    "until doubled, and bake it in a very hot oven until the crust is deep brown.",
    "A hash table stores keys in an array of buckets. A hash function maps each key to a bucket; "
    "when two keys land in the same bucket, the table resolves the collision by chaining or by "
    "probing other slots. Lookups take constant time on average if the load stays low.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about the cost of repairs to the library roof, the members agreed to postpone "
    "the new playground and to ask the council for an additional grant.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. In the leaves, "
    "chlorophyll absorbs red and blue light; the energy splits water molecules, and the "
    "hydrogen is used to build glucose from carbon dioxide drawn in through tiny pores.",
    "She opened the letter slowly, as if the words inside might escape. It was from her brother, "
    "who had not written in eleven years. He was well, he said, and living by the sea, and he "
    "wondered whether she still kept the old blue bicycle their father had repaired.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n# The loop keeps only the last two "
    "values, so it runs in linear time and constant memory.",
    "Question: why does the moon show phases? Answer: the moon is always half lit by the sun, "
    "but as it orbits the earth we see different amounts of its lit half, from none at the new "
    "moon to all of it at the full moon, and back again over about a month.",
)


def prompt_ids(tokenizer, source: str | Path | list[str] | None, count: int, max_tokens: int
                ) -> list[list[int]]:
    """Up to `count` prompts as token ids (at least 2 tokens each), from `source`: None, the
    built-in set; a path, a workload file; a list, those texts. No usable prompt is a
    ValueError naming the source."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: the prompt set is text")
    texts = (BUILTIN if source is None else source if isinstance(source, list)
             else _workload_texts(Path(source)))
    out = []
    for t in texts:
        ids = list(tokenizer.encode(t) if isinstance(t, str) else t)[:max_tokens]
        if len(ids) >= 2:
            out.append(ids)
        if len(out) == count:
            break
    if not out:
        where = "the session" if isinstance(source, list) else source
        raise ValueError(f"{where}: no prompt of 2 tokens or more")
    return out


def _workload_texts(path: Path) -> list:
    from kvscope.lab.workload import load_workload

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    return [r.prefix_text + r.prompt if r.prompt is not None else r.prompt_ids
            for r in load_workload(path).requests]

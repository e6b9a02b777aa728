"""Build the prompts of the two SmolLM2 recipes, deterministically from a seed.

    python scripts/make_smollm2_data.py      # writes assets/reviews and assets/word-arith

Each task has a training split and two held-out splits, held out by construction (checked on
content, not strings, by tests/test_heldout_data.py):

* `test_id` (in distribution): the training templates, names, objects, stems, genres, aspects
  and number ranges, but content no training item has: no (operation, {a, b}) of a training
  word problem, no (stem, genre, aspect) of a training review opening (a film title is surface,
  not content: two openings that differ only in the title are the same item). It measures
  whether training taught the task rather than the training items.
* `test_ood` (out of distribution): templates, names, objects, number ranges, stems, genres,
  aspects and film titles that no training item uses. It measures whether what was learned
  carries beyond the training distribution's surface.

Every held-out item's content occurs once in its split (no two items are the same problem or
the same opening up to the title), so each split's 200+ items are 200+ independent questions.

* `assets/reviews/{train,test_id,test_ood}.jsonl` (`query`): openings of movie reviews for the
  IMDB experiment in miniature. IMDB itself needs the hub, so the openings are generated: a stem
  ("I rented {title} last weekend and"), a made-up title, a genre and an aspect of a film.
  The stems are neutral on purpose (no sentiment words), so the continuation carries the
  sentiment.
* `assets/word-arith/{train,test_id,test_ood}.jsonl` (`question`, `answer` as GSM8K's `#### n`,
  `kind`): one-step word problems ("Mia has 7 stickers and gets 5 more. How many stickers does
  Mia have now?") over addition and subtraction of small numbers, which SmolLM2-135M-Instruct
  solves often enough when sampled (see the recipe's header) to learn from. Training: additions
  of 2-29 and 2-9, subtractions from 10-29 of 1-9; out of distribution: additions of 30-49 and
  10-19, subtractions from 50-79 of 10-29 (two two-digit operands).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TITLES = [
    "The Silent Harbor",
    "Midnight Express Lane",
    "A Winter in Lisbon",
    "Red Canyon",
    "The Last Lighthouse",
    "Paper Kingdoms",
    "Blue Orchard",
    "The Glass Road",
    "Night Shift",
    "Echoes of August",
    "The Iron Garden",
    "Northern Lights",
    "A House on Elm Street",
    "The Quiet Year",
    "Steel River",
    "Broken Compass",
    "The Long Summer",
    "City of Bridges",
    "The Painted Veil Road",
    "Small Hours",
    "The Tin Soldier",
    "Harbor Lights",
    "Wild Country",
    "The Second Door",
    "Salt and Stone",
    "The Orchard Keeper",
    "Lost in Marrakesh",
    "Dust and Thunder",
    "The Violet Hour",
    "Cold Water",
    "The Hollow Men",
    "Summer of '82",
    "The Lantern Maker",
    "Crossing the Line",
    "Ghost Town Radio",
    "The Copper Bell",
    "Eastbound",
    "The Forgotten Shore",
    "Moonrise Avenue",
    "The Clockwork Heart",
]
GENRES = [
    "horror film",
    "comedy",
    "western",
    "war movie",
    "romantic comedy",
    "thriller",
    "science fiction film",
    "documentary",
    "musical",
    "crime drama",
    "family movie",
    "period drama",
    "animated film",
    "action movie",
    "mystery",
]
ASPECTS = [
    "acting",
    "plot",
    "soundtrack",
    "camera work",
    "dialogue",
    "ending",
    "script",
    "lead actress",
    "lead actor",
    "pacing",
    "special effects",
    "director",
]
STEMS = [
    "I rented {title} last weekend and",
    "I watched {title} with my family and",
    "{title} is {a_genre} that",
    "When I first heard about {title}, I",
    "As a fan of every {genre} ever made, I went to see {title} and",
    "The {aspect} of {title}",
    "I saw {title} at a small theater downtown, and",
    "{title} tells the story of a man who",
    "My friend recommended {title}, {a_genre}, and",
    "This {genre} ({title}) was",
    "The first thing you notice about {title} is the {aspect}, which",
    "I went into {title} knowing nothing about it, and",
    "After reading the book, I watched {title} and",
    "{title}, the new {genre} from a first-time director,",
    "I have now seen {title} twice, and the {aspect}",
    "It took me a while to get around to {title}, but",
    "For {a_genre}, the {aspect} of {title}",
    "I expected more from the {aspect} of {title}, {a_genre} that",
    "In {title}, {a_genre} at heart, the {aspect}",
]


# Out of distribution: none of these occurs in training (tests/test_heldout_data.py checks).
OOD_TITLES = [
    "Falcon Street",
    "The Marble Staircase",
    "Seven Kettles",
    "Driftwood Parade",
    "The Amber Tunnel",
    "Pelican Bay",
    "Under the Pines",
    "The Ninth Passenger",
    "Velvet Alarm",
    "Granite Sky",
    "The Fox and the Ferry",
    "Lemon Tree Motel",
]
OOD_GENRES = [
    "heist film",
    "biopic",
    "space opera",
    "sports drama",
    "courtroom film",
    "zombie flick",
    "coming-of-age story",
    "disaster epic",
    "superhero film",
    "noir",
]
OOD_ASPECTS = [
    "costumes",
    "editing",
    "villain",
    "opening scene",
    "supporting cast",
    "set design",
    "makeup",
    "choreography",
    "locations",
    "final twist",
]
OOD_STEMS = [
    "Halfway through {title}, {a_genre}, I noticed that the {aspect}",
    "Nobody warned me that the {aspect} in {title} ({a_genre})",
    "My sister dragged me to {title}; for {a_genre}, its {aspect}",
    "Years after its release, {title} is still {a_genre} whose {aspect}",
    "On the flight home I caught {title}, {a_genre} where the {aspect}",
]


def a_genre(genre: str) -> str:
    return ("an " if genre[0] in "aeiou" else "a ") + genre


def slots(stem: str) -> tuple[bool, bool]:
    return "genre}" in stem, "{aspect}" in stem


def contents(stems: list[str], genres: list[str], aspects: list[str]) -> list[tuple]:
    """Every (stem, genre, aspect) an opening can say; a slot the stem lacks is None, so an
    opening without slots is one content whatever its title."""
    out = []
    for stem in stems:
        has_genre, has_aspect = slots(stem)
        for genre in genres if has_genre else [None]:
            for aspect in aspects if has_aspect else [None]:
                out.append((stem, genre, aspect))
    return out


def opening(content: tuple, title: str) -> dict:
    stem, genre, aspect = content
    genre_text = dict(genre=genre, a_genre=a_genre(genre)) if genre else {}
    return {"query": stem.format(title=title, aspect=aspect, **genre_text)}


def review_splits(rng: random.Random) -> dict[str, list[dict]]:
    """train: 600 openings over the training contents left after test_id took 200 contents
    with a genre or an aspect; test_id: those 200, once each, with training titles; test_ood:
    200 contents of unseen stems, genres and aspects, once each, with unseen titles."""
    with_slots = [c for c in contents(STEMS, GENRES, ASPECTS) if c[1] or c[2]]
    rng.shuffle(with_slots)
    held = with_slots[:200]
    train_contents = [c for c in contents(STEMS, GENRES, ASPECTS) if c not in set(held)]
    texts: set[str] = set()
    while len(texts) < 600:
        texts.add(opening(rng.choice(train_contents), rng.choice(TITLES))["query"])
    ood = contents(OOD_STEMS, OOD_GENRES, OOD_ASPECTS)
    rng.shuffle(ood)
    return {
        "train": sorted(({"query": t} for t in texts), key=lambda r: r["query"]),
        "test_id": [opening(c, rng.choice(TITLES)) for c in held],
        "test_ood": [opening(c, rng.choice(OOD_TITLES)) for c in ood[:200]],
    }


NAMES = ["Tom", "Ana", "Omar", "Mia", "Li", "Sara", "Ben", "Zoe", "Ravi", "Emma", "Kofi", "Ines"]
ITEMS = ["apples", "pens", "books", "cards", "marbles", "stickers", "coins", "shells", "stamps"]
ADD, SUB = "+", "-"
TEMPLATES = {  # kind -> (template, operation)
    "gets": ("{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?", ADD),
    "buys": (
        "{n} buys {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did {n} buy?",
        ADD,
    ),
    "gives": ("{n} has {a} {it} and gives away {b}. How many {it} does {n} have left?", SUB),
    "loses": ("{n} had {a} {it} and lost {b} of them. How many {it} does {n} have now?", SUB),
}
RANGES = {ADD: ((2, 29), (2, 9)), SUB: ((10, 29), (1, 9))}  # operation -> ranges of a and b

OOD_NAMES = ["Hugo", "Nadia", "Pablo", "Yuki", "Greta", "Tariq", "Lena", "Oscar", "Amara", "Felix"]
OOD_ITEMS = ["buttons", "candles", "tickets", "beads", "bottles", "feathers", "keys", "rocks"]
OOD_TEMPLATES = {
    "finds": (
        "There are {a} {it} in a box. {n} finds {b} more {it} and puts them in the box. "
        "How many {it} are in the box?",
        ADD,
    ),
    "collects": ("On a trip, {n} collected {a} {it} and then {b} {it}. What is the total?", ADD),
    "sells": (
        "A shop had {a} {it}. {n} sold {b} of them. How many {it} are still in the shop?",
        SUB,
    ),
    "uses": ("{n} started the week with {a} {it} and used up {b}. How many {it} remain?", SUB),
}
OOD_RANGES = {ADD: ((30, 49), (10, 19)), SUB: ((50, 79), (10, 29))}


def solve(op: str, a: int, b: int) -> int:
    return a + b if op == ADD else a - b


def pairs(op: str, ranges: dict) -> list[tuple[int, int]]:
    """Each (a, b) of an operation once up to order: {a, b} is the content, a + b = b + a."""
    (a_lo, a_hi), (b_lo, b_hi) = ranges[op]
    seen, out = set(), []
    for a in range(a_lo, a_hi + 1):
        for b in range(b_lo, b_hi + 1):
            if frozenset((a, b)) not in seen:
                seen.add(frozenset((a, b)))
                out.append((a, b))
    return out


def problem(kind: str, templates: dict, a: int, b: int, names, items, rng) -> dict:
    template, op = templates[kind]
    question = template.format(n=rng.choice(names), it=rng.choice(items), a=a, b=b)
    return {"question": question, "answer": f"#### {solve(op, a, b)}", "kind": kind}


def word_problem_splits(rng: random.Random) -> dict[str, list[dict]]:
    """test_id: 100 held-out (a, b) of each operation, once each, in a training template;
    train: every other (a, b) in both templates of its operation; test_ood: 100 (a, b) of each
    operation from the unseen ranges, once each, in an unseen template."""
    splits: dict[str, list[dict]] = {"train": [], "test_id": [], "test_ood": []}
    for op in (ADD, SUB):
        kinds = [k for k, (_, o) in TEMPLATES.items() if o == op]
        ood_kinds = [k for k, (_, o) in OOD_TEMPLATES.items() if o == op]
        operands = pairs(op, RANGES)
        rng.shuffle(operands)
        for a, b in operands[:100]:
            splits["test_id"].append(problem(rng.choice(kinds), TEMPLATES, a, b, NAMES, ITEMS, rng))
        for a, b in operands[100:]:
            for kind in kinds:
                splits["train"].append(problem(kind, TEMPLATES, a, b, NAMES, ITEMS, rng))
        ood = pairs(op, OOD_RANGES)
        rng.shuffle(ood)
        for a, b in ood[:100]:
            kind = rng.choice(ood_kinds)
            splits["test_ood"].append(problem(kind, OOD_TEMPLATES, a, b, OOD_NAMES, OOD_ITEMS, rng))
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def build(seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    """Every file's rows: {"reviews": {split: rows}, "word-arith": {split: rows}}."""
    rng = random.Random(seed)
    return {"reviews": review_splits(rng), "word-arith": word_problem_splits(rng)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("assets"))
    args = parser.parse_args()
    for task, splits in build(args.seed).items():
        for split, rows in splits.items():
            write(rows, args.out / task / f"{split}.jsonl")


if __name__ == "__main__":
    main()

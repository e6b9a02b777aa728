"""Build the prompts of the two SmolLM2 recipes, deterministically from a seed.

    python scripts/make_smollm2_data.py      # writes assets/reviews and assets/word-arith

* `assets/reviews/{train,test}.jsonl` (`query`): openings of movie reviews for the IMDB
  experiment in miniature. IMDB itself needs the hub, so the openings are generated: a stem
  ("I rented {title} last weekend and"), a made-up title, a genre and an aspect of a film.
  The stems are neutral on purpose (no sentiment words), so the continuation carries the
  sentiment. Train and test are disjoint by construction: they use different titles.
* `assets/word-arith/{train,test}.jsonl` (`question`, `answer` as GSM8K's `#### n`): one-step
  word problems ("Mia has 7 stickers and gets 5 more. How many stickers does Mia have now?")
  over addition and subtraction of small numbers, which SmolLM2-135M-Instruct solves often
  enough when sampled (see the recipe's header) to learn from. Train and test are disjoint:
  no (template, a, b) triple is in both.
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
]


def review_openings(titles: list[str], rng: random.Random, n: int) -> list[dict]:
    rows = set()
    while len(rows) < n:
        stem, genre = rng.choice(STEMS), rng.choice(GENRES)
        a_genre = ("an " if genre[0] in "aeiou" else "a ") + genre
        text = stem.format(
            title=rng.choice(titles), genre=genre, a_genre=a_genre, aspect=rng.choice(ASPECTS)
        )
        rows.add(text)
    return [{"query": text} for text in sorted(rows)]


NAMES = ["Tom", "Ana", "Omar", "Mia", "Li", "Sara", "Ben", "Zoe", "Ravi", "Emma", "Kofi", "Ines"]
ITEMS = ["apples", "pens", "books", "cards", "marbles", "stickers", "coins", "shells", "stamps"]
PROBLEMS = {  # template -> (operand ranges, answer)
    "gets": (
        "{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?",
        (2, 20),
        (2, 9),
        lambda a, b: a + b,
    ),
    "buys": (
        "{n} buys {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did {n} buy?",
        (2, 20),
        (2, 9),
        lambda a, b: a + b,
    ),
    "gives": (
        "{n} has {a} {it} and gives away {b}. How many {it} does {n} have left?",
        (10, 20),
        (1, 9),
        lambda a, b: a - b,
    ),
    "loses": (
        "{n} had {a} {it} and lost {b} of them. How many {it} does {n} have now?",
        (10, 20),
        (1, 9),
        lambda a, b: a - b,
    ),
}


def word_problems(rng: random.Random) -> list[dict]:
    rows = []
    for kind, (template, (a_lo, a_hi), (b_lo, b_hi), solve) in PROBLEMS.items():
        for a in range(a_lo, a_hi + 1):
            for b in range(b_lo, b_hi + 1):
                n, it = rng.choice(NAMES), rng.choice(ITEMS)
                question = template.format(n=n, it=it, a=a, b=b)
                rows.append({"question": question, "answer": f"#### {solve(a, b)}", "kind": kind})
    rng.shuffle(rows)
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("assets"))
    args = parser.parse_args()
    rng = random.Random(args.seed)

    titles = TITLES[:]
    rng.shuffle(titles)
    write(review_openings(titles[:30], rng, 600), args.out / "reviews" / "train.jsonl")
    write(review_openings(titles[30:], rng, 200), args.out / "reviews" / "test.jsonl")

    problems = word_problems(rng)
    write(problems[:200], args.out / "word-arith" / "test.jsonl")
    write(problems[200:], args.out / "word-arith" / "train.jsonl")


if __name__ == "__main__":
    main()

"""Write ``corpus.txt``: a few hundred KB of generated fables, the training text of
``examples/train.py``.

Why generated: the example must run on a machine with no network, and the text must
be free of any copyright question. A small grammar of characters, places, events,
dialogue and morals, driven by a seeded ``random.Random``, gives English-like text
with enough structure (titles, paragraphs, quotes, a moral at the end of each story)
that a character-level model visibly learns it within two minutes on a CPU.

The output is a pure function of ``--seed`` and ``--size``; the shipped file was made
with the defaults, and ``tests/test_train_example.py`` checks that it still is
(``random.Random``'s integer seeding, ``random()``, ``choice`` and ``randint`` have
been stable since Python 3.2).

    python examples/data/make_corpus.py            # rewrites examples/data/corpus.txt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT_SEED = 1729
DEFAULT_SIZE = 300_000  # bytes, approximately (the last story is finished)
DEFAULT_PATH = Path(__file__).with_name("corpus.txt")

ANIMALS = [
    "fox", "crow", "hare", "tortoise", "wolf", "lamb", "lion", "mouse", "ant",
    "grasshopper", "owl", "goat", "dog", "cat", "heron", "frog", "bear", "bee",
    "stag", "donkey", "rooster", "eagle", "badger", "swan",
]  # fmt: skip
PEOPLE = [
    "miller", "shepherd", "fisherman", "weaver", "blacksmith", "farmer", "baker",
    "woodcutter", "sailor", "potter", "merchant", "king", "old woman", "young prince",
]  # fmt: skip
ADJECTIVES = [
    "clever", "proud", "hungry", "patient", "lazy", "honest", "greedy", "brave",
    "timid", "foolish", "wise", "busy", "old", "young", "quick", "gentle", "vain",
]  # fmt: skip
PLACES = [
    "near the old mill", "by the river", "at the edge of the forest",
    "in a small village", "on a green hill", "beside a deep well",
    "under a tall oak", "in the king's garden", "by the sea", "in a quiet valley",
    "among the reeds of the marsh", "at the foot of the mountain",
]  # fmt: skip
TIMES = [
    "One morning", "One evening", "Early one spring day", "On a cold winter night",
    "At harvest time", "One summer afternoon", "Before the sun was up",
    "When the first snow fell", "On the day of the great fair", "Late one autumn",
]  # fmt: skip
OBJECTS = [
    "a piece of cheese", "a golden apple", "a loaf of bread", "a bright coin",
    "a jar of honey", "a bundle of sticks", "a silver bell", "a basket of grapes",
    "a warm cloak", "a bag of grain", "a lantern", "a fine feather",
]  # fmt: skip
WANTS = [
    "wanted it for itself", "thought of a trick", "was too proud to ask",
    "decided to wait and watch", "could not stop talking about it",
    "wished to be admired", "remembered an old promise", "grew jealous",
]  # fmt: skip
SAYINGS = [
    "How fine you look today",
    "Surely you can sing more sweetly than any bird",
    "Let us share it, as friends do",
    "I will carry it for you, and ask for nothing",
    "Slow and steady, my friend",
    "Why work when the sun is shining",
    "There is enough for both of us",
    "Do not trust everyone who praises you",
    "I was only trying to help",
    "Give it to me, or you will be sorry",
    "Tomorrow will be soon enough",
    "Look before you leap",
]  # fmt: skip
REPLIES = [
    "Thank you, but I know what you are after",
    "Perhaps you are right",
    "I will think about it until morning",
    "You speak kindly, but your eyes are hungry",
    "Very well, let it be so",
    "Not today, and not tomorrow either",
    "I have heard that song before",
]  # fmt: skip
ENDINGS = [
    "In the end the {a} lost everything, and the {b} went home content.",
    "So the {b} kept {obj}, and the {a} learned to hold its tongue.",
    "When winter came, the {a} was cold and hungry, but the {b} had plenty.",
    "The two of them shared {obj} and were friends from that day on.",
    "The {a} ran off into the night, and was never seen {place} again.",
    "By the time the {a} returned, the {b} had already won the day.",
    "And the {b} laughed, for it had seen the trick from the start.",
]  # fmt: skip
MORALS = [
    "Flatterers live at the expense of those who listen to them.",
    "Slow but steady wins the race.",
    "It is best to prepare for the days of need.",
    "A kindness is never wasted.",
    "Greed often overreaches itself.",
    "Look before you leap.",
    "Pride goes before a fall.",
    "United we stand, divided we fall.",
    "Do not count your chickens before they are hatched.",
    "Little friends may prove great friends.",
    "Appearances are often deceptive.",
    "Honesty is the best policy.",
]  # fmt: skip


def _character(rng: random.Random) -> str:
    """One of the story's two characters: mostly animals, sometimes people."""
    return rng.choice(ANIMALS) if rng.random() < 0.75 else rng.choice(PEOPLE)


def _article(word: str) -> str:
    """English's indefinite article, including the silent h of "honest"."""
    return "an" if word[0] in "aeiou" or word.startswith("hon") else "a"


def fable(rng: random.Random, number: int) -> str:
    """One story: a title, three or four paragraphs with dialogue, and a moral."""
    a = _character(rng)
    b = _character(rng)
    while b == a:
        b = _character(rng)
    adj_a, adj_b = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    obj, place = rng.choice(OBJECTS), rng.choice(PLACES)
    lines = [f"{number}. THE {a.upper()} AND THE {b.upper()}", ""]
    lines.append(
        f"Once upon a time, {_article(adj_a)} {adj_a} {a} lived {place}. "
        f"Not far away lived {_article(adj_b)} {adj_b} {b}, "
        f"who had {rng.randint(2, 9)} friends and {rng.randint(2, 5)} enemies."
    )
    lines.append("")
    lines.append(
        f"{rng.choice(TIMES)} the {a} saw the {b} with {obj}. "
        f"The {a} {rng.choice(WANTS)}, and the {b} {rng.choice(WANTS)}."
    )
    lines.append("")
    for _ in range(rng.randint(1, 3)):
        speaker, listener = (a, b) if rng.random() < 0.6 else (b, a)
        lines.append(f'"{rng.choice(SAYINGS)}," said the {speaker}.')
        lines.append(f'"{rng.choice(REPLIES)}," answered the {listener}.')
    lines.append("")
    ending = rng.choice(ENDINGS).format(a=a, b=b, obj=obj, place=place)
    lines.append(ending)
    lines.append("")
    lines.append(f"Moral: {rng.choice(MORALS)}")
    lines.append("")
    lines.append("")
    return "\n".join(lines)


def generate(seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE) -> str:
    """Stories until the text reaches ``size`` bytes; ASCII only, so bytes == chars."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    number = 1
    while total < size:
        story = fable(rng, number)
        parts.append(story)
        total += len(story)
        number += 1
    return "".join(parts)


def main() -> None:
    """Command line: write the corpus (defaults reproduce the shipped file)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="bytes")
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args()
    text = generate(args.seed, args.size)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {len(text):,} bytes to {args.out}")


if __name__ == "__main__":
    main()

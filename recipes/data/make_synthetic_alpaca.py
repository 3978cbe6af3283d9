#!/usr/bin/env python3
"""Generate recipes/data/synthetic-alpaca.jsonl: a small, seeded, alpaca-format dataset of
templated instruction tasks (arithmetic, antonyms, capitals, word order, counting, colours).

Small enough to commit and learnable by a tiny model in a few minutes, so the offline default
recipe shows real learning. Deterministic: the same seed always writes the same bytes.

    python3 recipes/data/make_synthetic_alpaca.py [--rows 3000] [--seed 7] [--out PATH]
"""
import argparse
import json
import os
import random

NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
ANTONYMS = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("early", "late"),
            ("happy", "sad"), ("light", "dark"), ("open", "closed"), ("full", "empty"), ("old", "new"),
            ("strong", "weak"), ("high", "low"), ("wet", "dry"), ("soft", "hard"), ("near", "far")]
CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
            ("Canada", "Ottawa"), ("Chile", "Santiago"), ("India", "New Delhi"), ("Ghana", "Accra")]
COLOURS = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("coal", "black"),
           ("a banana", "yellow"), ("a tomato", "red"), ("an orange", "orange"), ("a plum", "purple")]
WORDS = "apple river stone cloud tiger music garden window candle forest bridge rocket".split()


def arithmetic(r):
    a, b = r.randint(0, 6), r.randint(0, 6)
    if r.random() < 0.5:
        return (f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", "",
                f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}.")
    a, b = max(a, b), min(a, b)
    return (f"What is {NUMBERS[a]} minus {NUMBERS[b]}?", "",
            f"{NUMBERS[a].capitalize()} minus {NUMBERS[b]} is {NUMBERS[a - b]}.")


def antonym(r):
    a, b = r.choice(ANTONYMS)
    if r.random() < 0.5:
        a, b = b, a
    return ("Give the opposite of the word.", a, f"The opposite of {a} is {b}.")


def capital(r):
    c, k = r.choice(CAPITALS)
    return (f"What is the capital of {c}?", "", f"The capital of {c} is {k}.")


def reverse(r):
    ws = r.sample(WORDS, r.randint(2, 4))
    return ("Reverse the order of these words.", " ".join(ws), " ".join(reversed(ws)))


def count(r):
    ws = r.sample(WORDS, r.randint(1, 6))
    n = len(ws)
    return ("How many words are in the input?", " ".join(ws),
            f"There {'is' if n == 1 else 'are'} {NUMBERS[n]} word{'' if n == 1 else 's'}.")


def colour(r):
    t, c = r.choice(COLOURS)
    return (f"What colour is {t}?", "", f"{t[0].upper() + t[1:]} is {c}.")


TASKS = [arithmetic, antonym, capital, reverse, count, colour]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic-alpaca.jsonl"))
    a = p.parse_args()
    r = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8", newline="\n") as f:
        for _ in range(a.rows):
            instruction, inp, output = r.choice(TASKS)(r)
            f.write(json.dumps({"instruction": instruction, "input": inp, "output": output}) + "\n")


if __name__ == "__main__":
    main()
